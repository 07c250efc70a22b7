"""Step 2: data parallelism by hand. Each process trains on its own shard of the data,
and after backward the gradients are averaged across processes with all_reduce.

    torchrun --nproc-per-node=2 scripts/train_allreduce.py --mode bucket

--mode per-parameter: one all_reduce per parameter tensor;
--mode bucket: all gradients flattened into one tensor, one all_reduce.
Step 2b (scripts/own_ddp.py) starts the all_reduces during backward instead:
--mode overlap: one per parameter; --mode overlap-bucket: one per bucket of --bucket-mb MiB.
"""
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data.distributed import DistributedSampler

import own_ddp
from core import cli, data, distributed, models, training


def average_gradients_per_parameter(model):
    """Sum each gradient over all ranks, then divide: every rank ends with the mean."""
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size


def average_gradients_bucket(model):
    """The same mean with one collective: fewer, larger messages cost less latency."""
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    bucket = _flatten_dense_tensors(grads)
    dist.all_reduce(bucket, op=dist.ReduceOp.SUM)
    bucket /= dist.get_world_size()
    for grad, averaged in zip(grads, _unflatten_dense_tensors(bucket, grads)):
        grad.copy_(averaged)


AVERAGE_GRADIENTS = {"per-parameter": average_gradients_per_parameter, "bucket": average_gradients_bucket,
                     # Step 2b: hooks started the all_reduces during backward; after it, only the wait is left.
                     "overlap": own_ddp.wait_for_gradients, "overlap-bucket": own_ddp.wait_for_gradients}


def broadcast_parameters(model):
    """Start every rank from rank 0's weights and buffers."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def add_arguments(parser):
    parser.add_argument("--mode", choices=list(AVERAGE_GRADIENTS), default="bucket", help="how gradients are averaged")
    parser.add_argument("--bucket-mb", type=cli.positive_float, default=own_ddp.DEFAULT_BUCKET_MB,
                        help="bucket size in MiB for --mode overlap-bucket")


def main(argv=None):
    args = cli.parse_args(argv, description=__doc__, add_arguments=add_arguments)
    runtime = distributed.this_process(args)
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)  # before init: NCCL and this process's tensors use this GPU
    dist.init_process_group(runtime.backend, timeout=runtime.timeout)  # reads RANK, WORLD_SIZE, MASTER_* from torchrun
    distributed.preflight(runtime)  # one all_reduce now: a wrong world fails here, not in step 1
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir, runtime)
    model = models.build_model(args).to(runtime.device)
    broadcast_parameters(model)
    if args.mode in own_ddp.MODES:  # step 2b: a wrapper whose hooks start the all_reduces during backward
        model = own_ddp.wrap(model, args.mode, args.bucket_mb)
    # This rank's shard: every world_size-th index of one shuffle that all ranks share.
    sampler = DistributedSampler(train_set, num_replicas=runtime.world_size, rank=runtime.rank, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = training.make_optimizer(model, args)
    average_gradients = AVERAGE_GRADIENTS[args.mode]
    trainer = training.Trainer("train_allreduce", model, optimizer, scheduler, batches, test_set, runtime, args,
                               after_backward=lambda: average_gradients(model))
    for epoch in trainer.epochs():
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
        trainer.train_epoch(epoch)
    record = trainer.finish()
    dist.destroy_process_group()
    return record


if __name__ == "__main__":
    cli.run(main)
