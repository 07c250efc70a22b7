"""The data sets, and the two ways batches reach the model.

Data sets are read with ``torchvision.datasets`` and ``download=False``: training
never downloads (compute nodes often have no internet, and several ranks
downloading at once corrupt the files). ``scripts/download_data.py`` fetches them
once, on a login node. The default, ``mnist5k``, ships with the repository.

Two routes to batches, both driven by a sampler that decides which indices this
process sees in which order:
- ``TensorBatches``: the whole set is one normalised tensor on the device, and a
  batch is an index into it. MNIST fits in memory easily, and this skips the
  per-sample Python work that dominates small models.
- ``torch.utils.data.DataLoader`` with per-sample transforms, workers and
  pin_memory: the general route, and the one the notebooks compare against.
"""
import math
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler, Subset
from torchvision import datasets, transforms

from . import CourseError
from .distributed import fail_together, first_line

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

# name -> (where under --data-dir, torchvision class, the download_data.py argument)
DATASETS = {
    "mnist5k": ("mnist5k", datasets.MNIST, None),
    "mnist": (".", datasets.MNIST, "mnist"),
}


def mnist_transform():
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])


def load_datasets(name, data_dir, runtime=None):
    """(train, test) torchvision data sets, read from disk only.

    With ``runtime`` of a distributed run, every rank loads and the outcome is agreed:
    a data set missing or damaged on one node stops every rank with the same message.
    """
    if runtime is None:
        return read_datasets(name, data_dir)
    with fail_together(runtime):
        return read_datasets(name, data_dir)


def read_datasets(name, data_dir):
    if name not in DATASETS:
        raise CourseError(f"unknown --dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    subdir, dataset_class, download_name = DATASETS[name]
    root = Path(data_dir) / subdir
    fix = ("restore it with: git checkout -- data/" if download_name is None else
           f"fetch it on a machine with internet: python scripts/download_data.py {download_name} --data-dir {data_dir}")
    try:
        train = dataset_class(root, train=True, download=False, transform=mnist_transform())
        test = dataset_class(root, train=False, download=False, transform=mnist_transform())
    except RuntimeError as error:
        if "not found" in str(error):  # torchvision: "Dataset not found. You can use download=True ..."
            raise CourseError(f"{name} not found under {root}; {fix}") from None
        # The files are there but do not parse: a copy cut short, or overwritten.
        raise CourseError(f"{name} under {root} is damaged ({first_line(error)}); {fix}") from None
    return train, test


def as_tensors(dataset):
    """All images (N, C, H, W), normalised exactly as the transform does, and labels (N,)."""
    if isinstance(dataset, datasets.MNIST):
        images = dataset.data.unsqueeze(1).float().div(255)  # what ToTensor does, for all at once
        images = images.sub(MNIST_MEAN).div(MNIST_STD)  # what Normalize does
        return images, dataset.targets.clone()
    # Any other data set: run its own transform once over every sample.
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.as_tensor(labels)


class TensorBatches:
    """Batches cut from in-memory tensors in the order the sampler gives."""

    def __init__(self, dataset, sampler, batch_size, device):
        images, labels = as_tensors(dataset)
        self.images, self.labels = images.to(device), labels.to(device)
        self.sampler, self.batch_size = sampler, batch_size
        self.order = None  # the indices of the last epoch, in the order trained

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)  # the last batch may be short

    def __iter__(self):
        return self.iterate()

    def iterate(self, skip_batches=0, seed=None):
        """This epoch's batches, after the first ``skip_batches`` (already trained before a resume).
        (``seed`` is for the DataLoader route's workers; in-memory batches draw no random numbers.)"""
        self.order = torch.tensor(list(self.sampler))
        order = self.order.to(self.images.device)
        for start in range(skip_batches * self.batch_size, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            yield self.images[batch], self.labels[batch]

    def sample_inputs(self, count=2):
        """A few inputs, without touching the sampler (whose state decides the data order)."""
        return self.images[:count]


class SkippingSampler(Sampler):
    """Yields the wrapped sampler's indices after the first ``skip`` of them, and keeps
    the whole order of the epoch. The DataLoader asks it for indices in the main
    process, so setting ``skip`` before an epoch is enough, workers or not."""

    def __init__(self, sampler):
        self.sampler, self.skip, self.order = sampler, 0, None

    def __iter__(self):
        self.order = torch.tensor(list(self.sampler))
        return iter(self.order[self.skip:].tolist())

    def __len__(self):
        return max(0, len(self.sampler) - self.skip)


class LoaderBatches:
    """The DataLoader route: per-sample transforms, worker processes, pinned memory."""

    def __init__(self, dataset, sampler, batch_size, args):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.skipping = SkippingSampler(sampler)
        self.loader = DataLoader(
            dataset, batch_size=batch_size, sampler=self.skipping,
            num_workers=args.workers, pin_memory=args.pin_memory, persistent_workers=args.workers > 0,
        )

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        return self.iterate()

    def iterate(self, skip_batches=0, seed=None):
        """This epoch's batches after the first ``skip_batches``. ``seed`` seeds the loader's
        own generator (its workers' seeds), so that it draws nothing from the training's
        random stream."""
        self.skipping.skip = skip_batches * self.batch_size
        self.loader.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return iter(self.loader)

    @property
    def order(self):
        return self.skipping.order

    def sample_inputs(self, count=2):
        return torch.stack([self.dataset[i][0] for i in range(count)])


def train_batches(dataset, sampler, batch_size, args, device):
    """The training batches of this process, by the route ``--loader`` names."""
    if args.loader == "tensor":
        return TensorBatches(dataset, sampler, batch_size, device)
    return LoaderBatches(dataset, sampler, batch_size, args)


def evaluation_shard(dataset, rank, world_size):
    """Every rank-th sample, with no padding, so that the shards of all ranks
    together hold each test sample exactly once (DistributedSampler would pad
    the last shard with repeats and count them twice)."""
    return Subset(dataset, range(rank, len(dataset), world_size))
