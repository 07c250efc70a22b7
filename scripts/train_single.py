"""Step 1: the baseline. One process trains the model on one device.

    python scripts/train_single.py --epochs 3

Every later step is a small diff of this file:
    diff scripts/train_single.py scripts/train_allreduce.py
"""
import torch
from torch.utils.data import RandomSampler

from core import cli, data, distributed, models, training


def main(argv=None):
    args = cli.parse_args(argv, description=__doc__)
    runtime = distributed.this_process(args, single_process=True)
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir)
    model = models.build_model(args).to(runtime.device)
    # A new shuffle every epoch, drawn from a generator of its own (a resumed run restores it).
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(args.seed))
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = training.make_optimizer(model, args)
    trainer = training.Trainer("train_single", model, optimizer, scheduler, batches, test_set, runtime, args)
    for epoch in trainer.epochs():
        trainer.train_epoch(epoch)
    return trainer.finish()


if __name__ == "__main__":
    cli.run(main)
