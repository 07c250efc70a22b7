"""Step 3: nn.DataParallel. One process drives every visible GPU: each step it copies
the model to each GPU, splits the batch across them, and gathers the outputs back.

    python scripts/step3_data_parallel.py

On a machine with no GPU it still runs, as plain single-process training.
"""
import torch
import torch.nn as nn
from torch.utils.data import RandomSampler

from lesson import data, loop, models, process
from machinery import cli, job  # flags, checkpoints, records: a learner may skip them


def main(args):
    runtime = process.this_process(args, single_process=True)
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir)
    model = models.build_model(args).to(runtime.device)
    gpus = torch.cuda.device_count() if runtime.device.type == "cuda" else 0
    model = nn.DataParallel(model)  # with no GPU it simply calls the model: no parallelism
    print(f"DataParallel over {gpus} GPU(s)" if gpus else
          "DataParallel on CPU: no GPUs to split the batch across, so this runs as one process on one device",
          flush=True)
    # A new shuffle every epoch, drawn from a generator of its own (a resumed run restores it).
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(args.seed))
    # The batch is per GPU, as in the later steps: each step sees gpus x batch.
    batches = data.train_batches(train_set, sampler, args.batch_size * max(gpus, 1), args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, args, batches, runtime)
    trainer = loop.Trainer(model, optimizer, scheduler, batches, test_set, runtime, args,
                           callbacks=job.callbacks("step3_data_parallel", args, runtime))
    trainer.start()  # the outputs checked; with --resume, or after a restart, the newest checkpoint loaded
    for epoch in trainer.epochs():
        trainer.train_epoch(epoch)
    trainer.finish()


if __name__ == "__main__":
    cli.run(main, description=__doc__)  # parses the flags once, then calls main(args)
