"""Step 1: the baseline. One process trains the model on one device.

    python scripts/step1_baseline.py --epochs 3

Every later step is a small diff of this file:
    diff scripts/step1_baseline.py scripts/step2_allreduce.py
"""
import torch
from torch.utils.data import RandomSampler

from lesson import data, loop, models, process
from machinery import cli, job  # flags, checkpoints, records: a learner may skip them


def main(args):
    runtime = process.this_process(args, single_process=True)
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir)
    model = models.build_model(args).to(runtime.device)
    # A new shuffle every epoch, drawn from a generator of its own (a resumed run restores it).
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(args.seed))
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, args, batches, runtime)
    trainer = loop.Trainer(model, optimizer, scheduler, batches, test_set, runtime, args,
                           callbacks=job.callbacks("step1_baseline", args, runtime))
    trainer.start()  # the outputs checked; with --resume, or after a restart, the newest checkpoint loaded
    for epoch in trainer.epochs():
        trainer.train_epoch(epoch)
    trainer.finish()


if __name__ == "__main__":
    cli.run(main, description=__doc__)  # parses the flags once, then calls main(args)
