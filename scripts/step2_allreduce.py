"""Step 2: data parallelism by hand. Each process trains on its own shard of the data,
and after backward the gradients are averaged across processes with all_reduce.

    torchrun --nproc-per-node=2 scripts/step2_allreduce.py --mode bucket

--mode per-parameter: one all_reduce per parameter tensor;
--mode bucket: all gradients flattened into one tensor, one all_reduce.
Step 2b (scripts/step2b_own_ddp.py) starts the all_reduces during backward instead.
"""
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data.distributed import DistributedSampler

from lesson import data, loop, models, process
from machinery import cli, job  # flags, checkpoints, records: a learner may skip them


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


AVERAGE_GRADIENTS = {"per-parameter": average_gradients_per_parameter, "bucket": average_gradients_bucket}


def broadcast_parameters(model):
    """Start every rank from rank 0's weights and buffers."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def add_arguments(parser):
    parser.add_argument("--mode", choices=list(AVERAGE_GRADIENTS), default="bucket", help="how gradients are averaged")


def main(args):
    runtime = process.this_process(args)
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)  # before init: NCCL and this process's tensors use this GPU
    dist.init_process_group(runtime.backend, timeout=runtime.timeout)  # reads RANK, WORLD_SIZE, MASTER_* from torchrun
    process.preflight(runtime)  # one all_reduce now: a wrong world fails here, not in step 1
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir, runtime)
    model = models.build_model(args).to(runtime.device)
    broadcast_parameters(model)
    # This rank's shard: every world_size-th index of one shuffle that all ranks share.
    sampler = DistributedSampler(train_set, num_replicas=runtime.world_size, rank=runtime.rank, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, args, batches, runtime)
    average_gradients = AVERAGE_GRADIENTS[args.mode]
    trainer = loop.Trainer(model, optimizer, scheduler, batches, test_set, runtime, args,
                           after_backward=lambda: average_gradients(model),
                           callbacks=job.callbacks("step2_allreduce", args, runtime))
    trainer.start()  # the outputs checked; with --resume, or after a restart, the newest checkpoint loaded
    for epoch in trainer.epochs():
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
        trainer.train_epoch(epoch)
    trainer.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)  # parses the flags once, then calls main(args)
