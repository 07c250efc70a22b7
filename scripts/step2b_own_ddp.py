"""Step 2b: DDP written by hand. The all_reduces start during backward, not after it.

Step 2 averages the gradients after ``loss.backward()`` has returned, so the network sits
idle while the processes compute and the processes sit idle while the network works.
But the last layer's gradient is ready long before the first layer's: backward runs
from the output to the input. The wrappers here start each all_reduce as soon as its
gradients are ready, asynchronously, and let backward carry on; after backward, only the
wait is left. That is what DistributedDataParallel does inside ``loss.backward()``.

    torchrun --nproc-per-node=2 scripts/step2b_own_ddp.py --mode overlap
    torchrun --nproc-per-node=2 scripts/step2b_own_ddp.py --mode overlap-bucket --bucket-mb 1

It is step 2 with the averaging moved into backward (diff scripts/step2_allreduce.py scripts/step2b_own_ddp.py):

OverlapAllReduce         --mode overlap: one all_reduce per parameter, started by a hook
                         the moment that parameter's gradient is complete
BucketedOverlapAllReduce --mode overlap-bucket: parameters grouped, in reverse order,
                         into buckets of about --bucket-mb MiB; a bucket's all_reduce
                         starts when its last gradient arrives (fewer, larger messages)

Both work with gradient accumulation: inside ``no_sync()`` backward only adds to
``.grad``, and the all_reduces run in the backward of the last micro-batch, over the
accumulated gradients (the Trainer enters ``no_sync()`` for all but the last).
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data.distributed import DistributedSampler

from lesson import data, loop, models, process
from machinery import cli, job  # flags, checkpoints, records: a learner may skip them
from step2_allreduce import broadcast_parameters

MODES = ["overlap", "overlap-bucket"]

# DDP's first bucket holds up to 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), its
# others up to 25 MiB (bucket_cap_mb). For the course's Net, 1 MiB gives DDP's two buckets:
# [fc2, fc1] and [conv2, conv1].
DEFAULT_BUCKET_MB = 1.0


class OverlapAllReduce(nn.Module):
    """Wraps a model; every gradient is summed over the ranks by an all_reduce that starts
    during backward. Call ``finish_gradient_sync()`` after backward, before the optimizer step.
    """

    def __init__(self, module):
        super().__init__()
        self.module = module  # the plain model, as in DDP: checkpoints save model.module
        self.world_size = dist.get_world_size()
        self.sync = True
        self.in_flight = []  # (handle of an asynchronous all_reduce, what to do when it is done)
        for param in module.parameters():
            if param.requires_grad:
                # Runs once this backward has added everything it will to param.grad.
                param.register_post_accumulate_grad_hook(self.gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates into .grad (gradient accumulation)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def gradient_ready(self, param):
        if self.sync:
            self.in_flight.append((self.communicate(param.grad), param.grad))

    def communicate(self, tensor):
        """Start summing ``tensor`` over the ranks, in place; return at once with a handle.
        (The one place where communication happens: a subclass can watch or change it, as
        DDP's ``register_comm_hook`` allows.)"""
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)

    def finish_gradient_sync(self):
        """Wait for every all_reduce started during backward, then divide: the mean gradient."""
        for handle, grad in self.in_flight:
            handle.wait()
            grad /= self.world_size
        self.in_flight.clear()


class BucketedOverlapAllReduce(OverlapAllReduce):
    """The same, with one all_reduce per bucket of gradients instead of one per parameter."""

    def __init__(self, module, bucket_mb=DEFAULT_BUCKET_MB):
        super().__init__(module)
        self.buckets = buckets_in_reverse_order(module, bucket_mb)
        self.bucket_of = {id(param): index for index, bucket in enumerate(self.buckets) for param in bucket}
        self.start_backward()

    def start_backward(self):
        self.missing = [len(bucket) for bucket in self.buckets]  # gradients each bucket still waits for
        self.next_bucket = 0

    def gradient_ready(self, param):
        if not self.sync:
            return
        self.missing[self.bucket_of[id(param)]] -= 1
        # Buckets start in order, as DDP's do: every rank then issues the same all_reduces in
        # the same order, even if its gradients arrived in another order.
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            self.start_bucket(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def start_bucket(self, params):
        grads = [param.grad for param in params]
        flat = _flatten_dense_tensors(grads)  # one contiguous tensor: one message
        self.in_flight.append((self.communicate(flat), (flat, grads)))

    def finish_gradient_sync(self):
        if self.next_bucket < len(self.buckets):
            waiting = [i for i in range(self.next_bucket, len(self.buckets)) if self.missing[i]]
            raise RuntimeError(f"bucket(s) {waiting} never got all their gradients in this backward (a parameter "
                               f"the loss does not use?), so they were never all-reduced")
        for handle, (flat, grads) in self.in_flight:
            handle.wait()
            flat /= self.world_size
            for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(averaged)
        self.in_flight.clear()
        self.start_backward()


def buckets_in_reverse_order(module, bucket_mb):
    """The parameters, last layer first (the order backward produces their gradients),
    cut into buckets: a bucket closes once it holds ``bucket_mb`` MiB or more, as DDP's do."""
    limit = bucket_mb * 1024 * 1024
    buckets, current, size = [], [], 0
    for param in reversed([p for p in module.parameters() if p.requires_grad]):
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def wrap(model, mode, bucket_mb=DEFAULT_BUCKET_MB):
    """The wrapper ``--mode`` names."""
    return OverlapAllReduce(model) if mode == "overlap" else BucketedOverlapAllReduce(model, bucket_mb)


def add_arguments(parser):
    parser.add_argument("--mode", choices=MODES, default="overlap-bucket",
                        help="overlap: one all_reduce per parameter; overlap-bucket: one per bucket (default)")
    parser.add_argument("--bucket-mb", type=cli.positive_float, default=DEFAULT_BUCKET_MB,
                        help="bucket size in MiB for --mode overlap-bucket")


def main(args):
    runtime = process.this_process(args)
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)  # before init: NCCL and this process's tensors use this GPU
    dist.init_process_group(runtime.backend, timeout=runtime.timeout)  # reads RANK, WORLD_SIZE, MASTER_* from torchrun
    process.preflight(runtime)  # one all_reduce now: a wrong world fails here, not in step 1
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir, runtime)
    model = models.build_model(args).to(runtime.device)
    broadcast_parameters(model)
    model = wrap(model, args.mode, args.bucket_mb)  # its hooks start the all_reduces during backward
    # This rank's shard: every world_size-th index of one shuffle that all ranks share.
    sampler = DistributedSampler(train_set, num_replicas=runtime.world_size, rank=runtime.rank, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, args, batches, runtime)
    # After backward only the wait is left: for the all_reduces the hooks started, then the division.
    trainer = loop.Trainer(model, optimizer, scheduler, batches, test_set, runtime, args,
                           after_backward=model.finish_gradient_sync,
                           callbacks=job.callbacks("step2b_own_ddp", args, runtime))
    trainer.start()  # the outputs checked; with --resume, or after a restart, the newest checkpoint loaded
    for epoch in trainer.epochs():
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
        trainer.train_epoch(epoch)
    trainer.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)  # parses the flags once, then calls main(args)
