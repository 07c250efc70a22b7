"""DDP combined with model parallelism: each process's replica of the model spans two devices.

    torchrun --nproc-per-node=2 scripts/step6_model_parallel.py              # a node with 4 GPUs
    torchrun --nproc-per-node=2 scripts/step6_model_parallel.py --device cpu --dataset synthetic-cifar10

This is step4_ddp.py with two changes (diff the two files to see them):
- the model is cut in two: ResNet-18's stem, layer1 and layer2 on device 2*LOCAL_RANK,
  layer3, layer4 and the head on device 2*LOCAL_RANK+1. The forward pass carries the
  activations from the first device to the second, and the logits back to the first,
  where the inputs and labels are; autograd carries the gradients back the same way;
- DDP(model) without device_ids: device_ids names the single device of a one-device
  model, and a model on two devices must leave it out. DDP then averages each
  gradient on the device its parameter lives on.

Use it when one replica does not fit on one GPU: k processes on a node with 2k GPUs
train k replicas, each on its own shard of the data, each half the model per GPU.
The halves run one after the other (the second waits for the first's activations),
so a replica is not faster on two GPUs than on one; it only fits where it would not.

On a CPU both halves sit on the CPU, and the lesson runs anywhere. A node with fewer
than 2 GPUs per process stops with one line. Checkpoints hold the plain ResNet-18's
weights (the same names as the one-device model's): each rank reads them onto its
first device, and loading copies every tensor to the device of its parameter. Its
random state is the first device's (ResNet-18 draws no random numbers on a GPU).
"""
import dataclasses

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from kit.errors import CourseError
from lesson import data, loop, models, process
from lesson.model_parallel import TwoDeviceResNet, replica_devices
from machinery import cli, job  # flags, checkpoints, records: a learner may skip them


def add_arguments(parser):
    parser.set_defaults(dataset="cifar10", model="resnet18")


def main(args):
    runtime = process.this_process(args)
    first, second = replica_devices(runtime)
    runtime = dataclasses.replace(runtime, device=first)  # inputs, labels, loss and logits live on the first
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)  # before init: NCCL and this process's tensors use this GPU
    dist.init_process_group(runtime.backend, timeout=runtime.timeout)  # reads RANK, WORLD_SIZE, MASTER_* from torchrun
    process.preflight(runtime)  # one all_reduce now: a wrong world fails here, not in step 1
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir, runtime)
    if not args.model.startswith("resnet"):
        raise CourseError(f"this script cuts a ResNet in two; use --model resnet18 or resnet18-cifar, not {args.model}")
    model = TwoDeviceResNet(models.build_model(args), first, second)
    if runtime.is_main:
        print(f"each replica: {', '.join(model.FIRST_HALF)} on {first}; {', '.join(model.SECOND_HALF)} on {second}",
              flush=True)
    # No device_ids: the replica spans two devices. DDP broadcasts rank 0's weights, then averages gradients.
    model = DDP(model)
    # This rank's shard: every world_size-th index of one shuffle that all ranks share.
    sampler = DistributedSampler(train_set, num_replicas=runtime.world_size, rank=runtime.rank, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, args, batches, runtime)
    trainer = loop.Trainer(model, optimizer, scheduler, batches, test_set, runtime, args,
                           callbacks=job.callbacks("step6_model_parallel", args, runtime))
    trainer.start()  # the outputs checked; with --resume, or after a restart, the newest checkpoint loaded
    for epoch in trainer.epochs():
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
        trainer.train_epoch(epoch)
    trainer.finish()  # rank 0 writes the record and, with --save, model.module's weights
    dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)  # parses the flags once, then calls main(args)
