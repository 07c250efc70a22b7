"""``--dataset synthetic-cifar10``: images of CIFAR-10's shape, made up in memory (read by ``datasets.py``, which
imports this module only when the data set is asked for). Kit: a learner may skip this module."""
import torch
from torchvision import datasets


class SyntheticCIFAR10(datasets.CIFAR10):
    """Made-up images of CIFAR-10's shape and type (10,000 for training, 1,000 for testing: quick
    to make, and enough for a steady throughput), held and served exactly as torchvision's CIFAR10
    holds and serves its own: every code path of the real set runs, nothing is read from disk.

    Each image is its class's fixed random pattern plus as much noise, so a model can learn
    the classes (its accuracy shows that training works) but the numbers say nothing about
    CIFAR-10. For measuring speed, and for runs where CIFAR-10 cannot be downloaded.
    """

    SIZES = {True: 10_000, False: 1_000}

    def __init__(self, train, transform=None):
        datasets.VisionDataset.__init__(self, root=None, transform=transform)
        self.train, self.classes = train, [f"class {i}" for i in range(10)]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        patterns = torch.randint(0, 128, (10, 32, 32, 3), generator=torch.Generator().manual_seed(10),
                                 dtype=torch.uint8)
        generator = torch.Generator().manual_seed(11 if train else 12)  # the two splits differ
        labels = torch.randint(0, 10, (self.SIZES[train],), generator=generator)
        noise = torch.randint(0, 128, (len(labels), 32, 32, 3), generator=generator, dtype=torch.uint8)
        self.data = (patterns[labels] + noise).numpy()  # (N, 32, 32, 3) bytes, as CIFAR10 holds its images
        self.targets = labels.tolist()
