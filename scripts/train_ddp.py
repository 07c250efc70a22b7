"""Step 4: DistributedDataParallel. Each process trains on its own shard, as in the
hand-written step, but DDP averages the gradients during backward, in buckets,
overlapping communication with the rest of the backward pass.

    torchrun --nproc-per-node=2 scripts/train_ddp.py --save checkpoints/ddp.pt
"""
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from core import cli, data, distributed, models, training


def add_arguments(parser):
    parser.add_argument("--save", type=Path, default=None, help="save the trained weights here (rank 0 only)")


def main(argv=None):
    args = cli.parse_args(argv, description=__doc__, add_arguments=add_arguments)
    runtime = distributed.setup(args, process_group=True)
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir)
    model = models.build_model(args).to(runtime.device)
    # DDP broadcasts rank 0's weights at construction, then averages gradients in backward.
    model = DDP(model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None)
    distributed.reseed_for_training(args.seed, runtime)
    # This rank's shard: every world_size-th index of the same per-epoch shuffle.
    sampler = DistributedSampler(train_set, num_replicas=runtime.world_size, rank=runtime.rank, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = training.make_optimizer(model, args)
    record = training.fit("train_ddp", model, optimizer, scheduler, batches, test_set, runtime, args)
    if args.save:
        distributed.save_checkpoint(model, args.save, runtime)  # rank 0 writes model.module's weights
    return record


if __name__ == "__main__":
    cli.run(main)
