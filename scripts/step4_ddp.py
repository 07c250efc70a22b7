"""Step 4: DistributedDataParallel. Each process trains on its own shard, as in the
hand-written step, but DDP averages the gradients during backward, in buckets,
overlapping communication with the rest of the backward pass.

    torchrun --nproc-per-node=2 scripts/step4_ddp.py --save checkpoints/ddp.pt
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from lesson import data, loop, models, process
from machinery import cli, job  # flags, checkpoints, records: a learner may skip them


def main(args):
    runtime = process.this_process(args)
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)  # before init: NCCL and this process's tensors use this GPU
    dist.init_process_group(runtime.backend, timeout=runtime.timeout)  # reads RANK, WORLD_SIZE, MASTER_* from torchrun
    process.preflight(runtime)  # one all_reduce now: a wrong world fails here, not in step 1
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir, runtime)
    model = models.build_model(args).to(runtime.device)
    # DDP broadcasts rank 0's weights at construction, then averages gradients in backward.
    model = DDP(model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None)
    # This rank's shard: every world_size-th index of one shuffle that all ranks share.
    sampler = DistributedSampler(train_set, num_replicas=runtime.world_size, rank=runtime.rank, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, args, batches, runtime)
    trainer = loop.Trainer(model, optimizer, scheduler, batches, test_set, runtime, args,
                           callbacks=job.callbacks("step4_ddp", args, runtime))
    trainer.start()  # the outputs checked; with --resume, or after a restart, the newest checkpoint loaded
    for epoch in trainer.epochs():
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
        trainer.train_epoch(epoch)
    trainer.finish()  # rank 0 writes the record and, with --save, model.module's weights
    dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main, description=__doc__)  # parses the flags once, then calls main(args)
