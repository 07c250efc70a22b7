"""The data: batches cut from in-memory tensors in the order a sampler gives, and the evaluation shard.

The data sets are torchvision's, read from disk only: training never downloads (compute nodes often have
no internet, and ranks downloading at once corrupt the files). A sampler decides which indices this
process sees, in which order: ``RandomSampler`` in one process, ``DistributedSampler`` (this rank's shard
of one shuffle all ranks share) in several. ``TensorBatches`` holds the whole set as one tensor on the
device and cuts each batch out of it by index, which skips the per-sample Python work that dominates small
models (``--loader dataloader``: a DataLoader with per-sample transforms, in kit/datasets.py).
"""
import math

import torch
from torch.utils.data import Subset

from kit import agreement, datasets


def load_datasets(name, data_dir, runtime=None):
    """(train, test) data sets. With ``runtime``, every rank loads and they agree on the outcome:
    a data set missing or damaged on one node stops every rank with the same line."""
    if runtime is None:
        return datasets.read_datasets(name, data_dir)
    with agreement.fail_together(runtime):
        return datasets.read_datasets(name, data_dir)


class TensorBatches:
    """Batches cut from in-memory tensors in the order the sampler gives."""

    def __init__(self, dataset, sampler, batch_size, device, augment=None):
        images, labels = datasets.as_tensors(dataset)  # normalised as the test transform does
        self.images, self.labels = images.to(device), labels.to(device)
        self.sampler, self.batch_size, self.augment = sampler, batch_size, augment
        self.order = None  # the indices of the last epoch, in the order trained

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)  # the last batch may be short

    def __iter__(self):
        return self.iterate()

    def iterate(self, skip_batches=0, seed=None):
        """This epoch's batches, after the first ``skip_batches`` (already trained before a resume).
        ``seed``: the epoch's seed, from which each batch's augmentation is drawn (None: 0)."""
        self.order = torch.tensor(list(self.sampler))
        order = self.order.to(self.images.device)
        for index in range(skip_batches, len(self)):
            batch = order[index * self.batch_size:(index + 1) * self.batch_size]
            images = self.images[batch]
            if self.augment is not None:  # CIFAR-10's crops and flips, drawn from (seed, batch) alone
                images = self.augment(images, seed or 0, index)
            yield images, self.labels[batch]

    def sample_inputs(self, count=2):
        """A few inputs, without touching the sampler (whose state decides the data order)."""
        return self.images[:count]


def train_batches(dataset, sampler, batch_size, args, device):
    """The training batches of this process, by the route ``--loader`` names."""
    if args.loader == "tensor":
        return TensorBatches(dataset, sampler, batch_size, device, augment=datasets.batch_augmentation(args.dataset))
    return datasets.LoaderBatches(dataset, sampler, batch_size, args.workers, args.pin_memory)


def epoch_seed(seed, epoch, rank):
    """The seed of one rank's epoch, for its batches' augmentation: a resumed run draws the same."""
    return (seed * 1_000_003 + epoch) * 1_009 + rank


def evaluation_shard(dataset, rank, world_size):
    """Every world_size-th sample, with no padding, so that the shards of all ranks together
    hold each test sample exactly once (DistributedSampler would pad the last shard with
    repeats and count them twice)."""
    return Subset(dataset, range(rank, len(dataset), world_size))
