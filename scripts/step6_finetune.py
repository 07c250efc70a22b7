"""Fine-tuning a pretrained ResNet-18 with DDP, on an ImageFolder such as the ants and bees of
the PyTorch transfer-learning tutorial.

    python scripts/tools/download_data.py hymenoptera resnet18-weights      # once, on a machine with internet
    torchrun --nproc-per-node=2 scripts/step6_finetune.py --pretrained --finetune head

This is step4_ddp.py with three additions (diff the two files to see them): the model
starts from pretrained weights (--pretrained: torchvision's ImageNet weights; --weights
FILE: any ResNet-18 state_dict, such as another run's --save), its output layer starts
fresh with one output per class folder, and --finetune chooses what trains: the head
alone, with the rest frozen, or every layer. A frozen parameter has no gradient, so DDP
has nothing of it to all-reduce: only the head's gradients are all-reduced (DDP still
broadcasts the model's buffers, BatchNorm's running statistics, before every forward).

It is a script of its own, not options of the four step scripts, so that each of those
stays a small diff of the one before, and this one shows as a diff what fine-tuning
adds. Any step script can train a ResNet-18 from scratch on an ImageFolder
(--dataset imagefolder --model resnet18); this one starts from pretrained weights.

Its defaults: --dataset imagefolder --data-dir data/hymenoptera_data --model resnet18,
SGD (momentum 0.9) with lr 0.001 and 8 images per process per step.
"""
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from kit import agreement, datasets
from lesson import data, loop, models, process
from machinery import cli, finetune, job  # flags, checkpoints, records: a learner may skip them


def add_arguments(parser):
    parser.set_defaults(dataset="imagefolder", data_dir=cli.DEFAULT_DATA_DIR / datasets.HYMENOPTERA_FOLDER,
                        model="resnet18", optimizer="sgd", lr=1e-3, batch_size=8)
    start = parser.add_argument_group("fine-tuning").add_mutually_exclusive_group(required=True)
    start.add_argument("--pretrained", action="store_true",
                       help="start from torchvision's ImageNet weights "
                            "(python scripts/tools/download_data.py resnet18-weights puts them in the torch hub cache)")
    start.add_argument("--weights", type=Path, default=None, help="start from this state_dict file instead")
    parser.add_argument("--finetune", choices=["head", "all"], default="head",
                        help="head: train the output layer alone, the rest frozen (default); all: train every layer")


def main(args):
    runtime = process.this_process(args)
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)  # before init: NCCL and this process's tensors use this GPU
    dist.init_process_group(runtime.backend, timeout=runtime.timeout)  # reads RANK, WORLD_SIZE, MASTER_* from torchrun
    process.preflight(runtime)  # one all_reduce now: a wrong world fails here, not in step 1
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir, runtime)
    with agreement.fail_together(runtime):  # weights missing on one node stop every rank with the same line
        pretrained = finetune.read_weights(args.weights)  # None: --pretrained
        model = models.build_model(args)  # a fresh head: one output per class of this data set
        finetune.load_all_but_head(model, pretrained, args.weights or "torchvision's ResNet-18 weights")
    finetune.freeze(model, args.finetune)  # head: requires_grad only for the output layer
    model = model.to(runtime.device)
    if runtime.is_main:
        trainable, total = finetune.trainable_parameters(model)
        print(f"--finetune {args.finetune}: {trainable:,} of {total:,} parameters train; DDP all-reduces "
              f"{finetune.gradient_bytes(model):,} bytes of gradients per step", flush=True)
    # DDP broadcasts rank 0's weights at construction, then averages the gradients there are in backward.
    model = DDP(model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None)
    # This rank's shard: every world_size-th index of one shuffle that all ranks share.
    sampler = DistributedSampler(train_set, num_replicas=runtime.world_size, rank=runtime.rank, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, args, batches, runtime)
    trainer = loop.Trainer(model, optimizer, scheduler, batches, test_set, runtime, args,
                           callbacks=job.callbacks("step6_finetune", args, runtime))
    trainer.start()  # the outputs checked; with --resume, or after a restart, the newest checkpoint loaded
    for epoch in trainer.epochs():
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
        trainer.train_epoch(epoch)
    trainer.finish()  # rank 0 writes the record and, with --save, model.module's weights
    dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)  # parses the flags once, then calls main(args)
