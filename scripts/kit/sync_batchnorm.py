"""SyncBatchNorm: BatchNorm with the statistics of the global batch (``--sync-bn``). Kit: a learner may skip this module
(notebook 07 teaches it).

In training, BatchNorm normalises every channel with the mean and variance of the batch in
front of it. Under data parallelism that batch is this rank's shard: with 32 images per
rank, the statistics come from 32 images, whatever the global batch. SyncBatchNorm sums
the statistics over the ranks, so every rank normalises with those of the global batch,
exactly as one process on the global batch would. It matters when the batch per device is
small (large images, detection, segmentation).

On a GPU, ``--sync-bn`` is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, unchanged.
PyTorch's SyncBatchNorm does not run on a CPU: its forward raises "SyncBatchNorm expected
input tensor to be on GPU" (it needs kernels such as ``torch.batch_norm_stats`` that are
built for GPUs), and DistributedDataParallel refuses a CPU model that holds one
("SyncBatchNorm layers only work with GPU modules"). So that ``--sync-bn`` runs, and is
tested, on CPUs with gloo too, the class below computes the same statistics with two
all_reduces; it is a plain BatchNorm subclass, which DDP accepts on a CPU.
"""
import torch
import torch.distributed as dist
from torch import nn

from .errors import CourseError


class AllReduceSum(torch.autograd.Function):
    """The sum of a tensor over all ranks, with a gradient.

    Every rank's input reaches every rank's output, so the gradient for a rank's input
    is the sum over the ranks of the gradients for their outputs: another all_reduce.
    """

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm with the statistics of the global batch, for CPUs (PyTorch's needs a GPU)."""

    def __init__(self, *args, process_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        if not self.training or self.world_size() < 2:
            return super().forward(input)  # evaluation, or one process: plain BatchNorm
        return self.forward_synchronised(input)

    def group(self):
        return self.process_group or dist.group.WORLD

    def world_size(self):
        return dist.get_world_size(self.group()) if dist.is_available() and dist.is_initialized() else 1

    def forward_synchronised(self, input):
        self._check_input_dim(input)
        momentum = self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if momentum is None:  # a cumulative average, as BatchNorm does with momentum=None
                momentum = 1.0 / self.num_batches_tracked.item()
        x = input.float()  # statistics in float32, also under bf16 autocast
        over = [0, *range(2, x.dim())]  # every dimension but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.size(1)], dtype=x.dtype, device=x.device)
        # 1. The global mean: sum the per-channel sums and the counts over the ranks.
        sums = AllReduceSum.apply(torch.cat([x.sum(over), count]), self.group())
        total = sums[-1]
        mean = sums[:-1] / total
        # 2. The global (biased) variance around that mean, as BatchNorm normalises with.
        centred = x - mean.view(shape)
        variance = AllReduceSum.apply((centred * centred).sum(over), self.group()) / total
        output = centred * torch.rsqrt(variance + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        if self.running_mean is not None:
            with torch.no_grad():  # the running variance is the unbiased one, as in BatchNorm
                self.running_mean.mul_(1 - momentum).add_(mean * momentum)
                self.running_var.mul_(1 - momentum).add_(variance * (total / (total - 1)) * momentum)
        return output.to(input.dtype)


def convert(model, model_name="the model", on_gpu=False):
    """Every BatchNorm layer of ``model`` replaced by a synchronised one holding the same state:
    PyTorch's on a GPU, the class above on a CPU. A model without BatchNorm is refused:
    --sync-bn would change nothing and say nothing."""
    if on_gpu:
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    else:
        converted = replace_batchnorm(model)
    if not any(isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)) for module in converted.modules()):
        raise CourseError(f"--sync-bn: --model {model_name} has no BatchNorm layer to synchronise; "
                          f"use a model with BatchNorm (--model net-bn) or leave --sync-bn out")
    return converted


def replace_batchnorm(module):
    if (isinstance(module, nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm))):
        synced = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats, bias=module.bias is not None)
        if module.affine:
            synced.weight, synced.bias = module.weight, module.bias
        synced.running_mean, synced.running_var = module.running_mean, module.running_var
        synced.num_batches_tracked = module.num_batches_tracked
        synced.train(module.training)
        module = synced
    for name, child in list(module.named_children()):
        module.add_module(name, replace_batchnorm(child))
    return module
