"""Step 3: nn.DataParallel. One process drives every visible GPU: each step it copies
the model to each GPU, splits the batch across them, and gathers the outputs back.

    python scripts/train_dp.py

On a machine with no GPU it still runs, as plain single-process training.
"""
import torch
import torch.nn as nn
from torch.utils.data import RandomSampler

from core import cli, data, distributed, models, training


def main(argv=None):
    args = cli.parse_args(argv, description=__doc__)
    runtime = distributed.this_process(args, single_process=True)
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
    optimizer, scheduler = training.make_optimizer(model, args)
    trainer = training.Trainer("train_dp", model, optimizer, scheduler, batches, test_set, runtime, args)
    for epoch in trainer.epochs():
        trainer.train_epoch(epoch)
    return trainer.finish()


if __name__ == "__main__":
    cli.run(main)
