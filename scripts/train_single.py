"""Step 1: the baseline. One process trains the model on one device.

    python scripts/train_single.py --epochs 3

Every later step is a small diff of this file:
    diff scripts/train_single.py scripts/train_allreduce.py
"""
from torch.utils.data.distributed import DistributedSampler

from core import cli, data, distributed, models, training


def main(argv=None):
    args = cli.parse_args(argv, description=__doc__)
    runtime = distributed.setup(args, process_group=False)
    train_set, test_set = data.load_datasets(args.dataset, args.data_dir)
    model = models.build_model(args).to(runtime.device)
    distributed.reseed_for_training(args.seed, runtime)
    # One replica: the whole training set, reshuffled each epoch from seed + epoch.
    # Every step of the course uses this sampler, so all steps see the same order.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=args.seed)
    batches = data.train_batches(train_set, sampler, args.batch_size, args, runtime.device)
    optimizer, scheduler = training.make_optimizer(model, args)
    return training.fit("train_single", model, optimizer, scheduler, batches, test_set, runtime, args)


if __name__ == "__main__":
    cli.run(main)
