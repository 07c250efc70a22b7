"""The data sets ``--dataset`` names, read from disk with one-line errors, and the DataLoader route.
Kit: a learner may skip this module (the lesson needs only that they are torchvision data sets).

    --dataset mnist5k             4,000 + 1,000 MNIST digits, bundled (1x28x28)
    --dataset mnist               the full MNIST (tools/download_data.py mnist)
    --dataset cifar10             CIFAR-10, 50,000 + 10,000 colour images (3x32x32; tools/download_data.py cifar10)
    --dataset synthetic-cifar10   10,000 + 1,000 images of CIFAR-10's shape, made up in memory (offline, for speed)
    --dataset imagefolder         --data-dir PATH with train/ and val/, one subfolder per class
                                  (the PyTorch transfer-learning tutorial's ants and bees:
                                  tools/download_data.py hymenoptera)

Augmentation. In-memory batches (``lesson/data.py``) get CIFAR-10's random crops and flips for the whole
batch at once, with random numbers from a generator of their own, seeded from (seed, epoch, rank, batch
index): never from the global stream that dropout uses, so a resumed run draws the very same crops and
flips as an uninterrupted one.

The DataLoader route (``--loader dataloader``): per-sample transforms, workers and pin_memory; the general
route, and the only one for an ImageFolder (its images differ in size, and each epoch crops them afresh
from the originals). Augmentation there is torchvision's own transforms, which draw from the global random
stream of the process that runs them. With ``--workers 0`` that is the training process, whose stream a
checkpoint saves: a resume is exact. With workers, each worker seeds its stream once, when it starts, and
the workers live for the whole run; a resumed run's new workers cannot continue those streams, so after a
resume the data order and the samples are exact but the random crops and flips are new draws
(tests/test_real_models.py shows both).
"""
import hashlib
import importlib
import math
import pickle
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler, Subset

from .errors import CourseError, first_line


class ImportedOnFirstUse:
    """Stands for the module ``name``, which is imported when one of its attributes is first read."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attribute):
        return getattr(importlib.import_module(self.name), attribute)


# torchvision is imported when a data set is read, not with this module: the scripts that read none (the doctor,
# most demos) start without it and the thousand modules it imports. (A process that trains imports most of them
# anyway: its optimizer imports torch._dynamo.)
datasets = ImportedOnFirstUse("torchvision.datasets")
transforms = ImportedOnFirstUse("torchvision.transforms")

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
# CIFAR-10's per-channel mean and standard deviation over its 50,000 training images
# (pixels in [0, 1]), the values in wide use with CIFAR training recipes.
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR10_PADDING = 4  # random crops of 32x32 out of the image padded by 4 black pixels on each side

# name -> (where under --data-dir, the class's name in torchvision.datasets, the download_data.py argument)
DATASETS = {
    "mnist5k": ("mnist5k", "MNIST", None),
    "mnist": (".", "MNIST", "mnist"),
    "cifar10": (".", "CIFAR10", "cifar10"),
}
SYNTHETIC = "synthetic-cifar10"
IMAGE_FOLDER = "imagefolder"
NAMES = [*DATASETS, SYNTHETIC, IMAGE_FOLDER]
# What one image is, per data set: the models check that they can take it (models.build_model).
IMAGE_SHAPES = {"mnist5k": (1, 28, 28), "mnist": (1, 28, 28), "cifar10": (3, 32, 32), SYNTHETIC: (3, 32, 32),
                IMAGE_FOLDER: (3, 224, 224)}
# Data sets whose images cannot be held as one tensor: they take the DataLoader route.
LOADER_ONLY = {IMAGE_FOLDER}
HYMENOPTERA_FOLDER = "hymenoptera_data"  # where download_data.py puts the tutorial's ants and bees, under data/


def mnist_transform():
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])


def cifar10_transforms():
    """(train, test): the usual augmentation for training (random crop of the padded image,
    horizontal flip); the test images only converted and normalised."""
    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    train = transforms.Compose([transforms.RandomCrop(32, padding=CIFAR10_PADDING), transforms.RandomHorizontalFlip(),
                                transforms.ToTensor(), normalize])
    return train, transforms.Compose([transforms.ToTensor(), normalize])


def imagenet_transforms():
    """(train, val) as ImageNet models are trained and evaluated, with the statistics and
    sizes of torchvision's ResNet-18 weights: a random crop of random size and shape,
    resized to 224, and a flip; for validation, resize to 256 and the central 224."""
    from torchvision.models import ResNet18_Weights

    evaluation = ResNet18_Weights.IMAGENET1K_V1.transforms()  # resize 256, centre crop 224, normalise
    train = transforms.Compose([transforms.RandomResizedCrop(evaluation.crop_size[0]),
                                transforms.RandomHorizontalFlip(),
                                transforms.ToTensor(), transforms.Normalize(evaluation.mean, evaluation.std)])
    return train, evaluation


def read_datasets(name, data_dir):
    if name not in NAMES:
        raise CourseError(f"unknown --dataset {name!r}; choose one of: {', '.join(NAMES)}")
    if name == SYNTHETIC:
        from .synthetic_cifar10 import SyntheticCIFAR10  # a subclass of torchvision's CIFAR10: imported when used

        train_transform, test_transform = cifar10_transforms()
        return SyntheticCIFAR10(True, train_transform), SyntheticCIFAR10(False, test_transform)
    if name == IMAGE_FOLDER:
        return read_image_folder(Path(data_dir))
    subdir, class_name, download_name = DATASETS[name]
    dataset_class = getattr(datasets, class_name)
    root = Path(data_dir) / subdir
    fix = ("restore it with: git checkout -- data/" if download_name is None else
           f"fetch it on a machine with internet: "
           f"python scripts/tools/download_data.py {download_name} --data-dir {data_dir}")
    if dataset_class is datasets.CIFAR10:
        train_transform, test_transform = cifar10_transforms()
        missing = [file for file in cifar10_files() if not (root / datasets.CIFAR10.base_folder / file).is_file()]
        if missing:  # torchvision says "not found or corrupted" for both; say which
            raise CourseError(f"cifar10 not found under {root} (no {datasets.CIFAR10.base_folder}/{missing[0]}); {fix}")
    else:
        train_transform = test_transform = mnist_transform()
    try:
        train = dataset_class(root, train=True, download=False, transform=train_transform)
        test = dataset_class(root, train=False, download=False, transform=test_transform)
    except (RuntimeError, OSError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as error:
        if dataset_class is datasets.CIFAR10 and "corrupted" in str(error):  # the files are there (checked above)
            reason = "their md5 sums are not CIFAR-10's"
        elif "not found" in str(error):  # torchvision's MNIST: "Dataset not found. You can use download=True ..."
            raise CourseError(f"{name} not found under {root}; {fix}") from None
        else:
            reason = first_line(error)
        # The files are there but do not parse, or do not match their checksums: a copy cut short, or overwritten.
        raise CourseError(f"{name} under {root} is damaged ({reason}); {fix}") from None
    return train, test


def cifar10_files():
    """The files torchvision's CIFAR10 reads (and checks the md5 sum of) in cifar-10-batches-py/."""
    return [name for name, _ in datasets.CIFAR10.train_list + datasets.CIFAR10.test_list] + [
        datasets.CIFAR10.meta["filename"]]


def read_image_folder(root):
    """An ImageFolder's train/ and val/ splits, with ImageNet-style transforms."""
    fix = ("give --data-dir a folder with train/ and val/, each with one subfolder of images per class (the transfer-"
           "learning tutorial's ants and bees: python scripts/tools/download_data.py hymenoptera, then "
           f"--data-dir data/{HYMENOPTERA_FOLDER})")
    missing = [split for split in ("train", "val") if not (root / split).is_dir()]
    if missing:
        raise CourseError(f"--dataset imagefolder: no {' and no '.join(f'{s}/' for s in missing)} in {root}; {fix}")
    train_transform, val_transform = imagenet_transforms()
    try:
        train = datasets.ImageFolder(root / "train", transform=train_transform)
        val = datasets.ImageFolder(root / "val", transform=val_transform)
    except (FileNotFoundError, ValueError) as error:  # no class folder, or a class folder with no image
        raise CourseError(f"--dataset imagefolder: {first_line(error)}; {fix}") from None
    if train.classes != val.classes:
        raise CourseError(f"--dataset imagefolder: train/ has the classes {train.classes} but val/ has {val.classes}; "
                          f"both need the same class folders")
    return train, val


def num_classes(name, data_dir):
    """How many classes the data set ``name`` has (an ImageFolder: its class folders)."""
    if name == IMAGE_FOLDER:
        return len(datasets.folder.find_classes(Path(data_dir) / "train")[0])
    return 10


def as_tensors(dataset):
    """All images (N, C, H, W), normalised as the test transform does, and labels (N,)."""
    whole = dataset.dataset if isinstance(dataset, Subset) else dataset
    if has_whole_arrays(whole):  # MNIST and CIFAR-10: converted all at once from the arrays they hold
        images, labels = whole_set_as_tensors(whole)
        if whole is not dataset:
            chosen = torch.as_tensor(dataset.indices, dtype=torch.long)
            images, labels = images[chosen], labels[chosen]
        return images, labels
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))  # any other: its transform, sample by sample
    return torch.stack(images), torch.as_tensor(labels)


def has_whole_arrays(dataset):
    """MNIST and CIFAR-10 hold every image in one array: ``whole_set_as_tensors`` converts them at once."""
    return isinstance(dataset, (datasets.MNIST, datasets.CIFAR10))


def whole_set_as_tensors(dataset):
    if isinstance(dataset, datasets.MNIST):
        images = dataset.data.unsqueeze(1).float().div(255)  # what ToTensor does, for all at once
        images = images.sub(MNIST_MEAN).div(MNIST_STD)  # what Normalize does
        return images, dataset.targets.clone()
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).float().div(255)  # HWC bytes -> CHW in [0, 1]
    mean, std = (torch.tensor(values).view(3, 1, 1) for values in (CIFAR10_MEAN, CIFAR10_STD))
    return images.sub(mean).div(std), torch.as_tensor(dataset.targets)


# ---------------------------------------------------------------- augmentation of in-memory batches

def crop_and_flip(images, tops, lefts, flips, padding, fill):
    """Each image padded by ``padding`` pixels of ``fill`` (one value per channel), cut back to
    its size at (top, left), and mirrored left-right where ``flips`` is True: torchvision's
    RandomCrop(padding=...) and RandomHorizontalFlip, for a whole batch at once."""
    n, channels, height, width = images.shape
    padded = fill.to(images).view(1, channels, 1, 1).repeat(n, 1, height + 2 * padding, width + 2 * padding)
    padded[:, :, padding:padding + height, padding:padding + width] = images
    rows = (tops.view(n, 1) + torch.arange(height)).to(images.device)  # (n, height): the rows each crop keeps
    columns = (lefts.view(n, 1) + torch.arange(width)).to(images.device)
    crops = padded[torch.arange(n, device=images.device).view(n, 1, 1, 1),
                   torch.arange(channels, device=images.device).view(1, channels, 1, 1),
                   rows.view(n, 1, height, 1), columns.view(n, 1, 1, width)]
    return torch.where(flips.to(images.device).view(n, 1, 1, 1), crops.flip(3), crops)


def cifar10_augment(images, generator):
    """CIFAR-10's training augmentation on a batch of normalised images, with random numbers
    from ``generator`` alone. The padding is black, as torchvision pads the image before
    normalising it: in normalised values, -mean / std."""
    n = len(images)
    shifts = torch.randint(0, 2 * CIFAR10_PADDING + 1, (2, n), generator=generator)
    flips = torch.rand(n, generator=generator) < 0.5
    black = -torch.tensor(CIFAR10_MEAN) / torch.tensor(CIFAR10_STD)
    return crop_and_flip(images, shifts[0], shifts[1], flips, CIFAR10_PADDING, black)


def batch_seed(epoch_seed, batch_index):
    """A seed for one batch's augmentation, from the epoch's seed (itself made from the run's
    seed, the epoch and the rank) and the batch's place in the epoch: any batch's random
    numbers can be drawn again without drawing those of the batches before it."""
    digest = hashlib.blake2b(f"{epoch_seed}/{batch_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: what torch.Generator.manual_seed takes


def augment_cifar10_batch(images, epoch_seed, batch_index):
    """CIFAR-10's crops and flips for one in-memory batch, drawn from (epoch seed, batch index) alone."""
    return cifar10_augment(images, torch.Generator().manual_seed(batch_seed(epoch_seed, batch_index)))


def batch_augmentation(name):
    """What the in-memory batches of data set ``name`` get (the DataLoader route runs its own transform)."""
    return augment_cifar10_batch if name in ("cifar10", SYNTHETIC) else None


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

    def __init__(self, dataset, sampler, batch_size, workers=0, pin_memory=False):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.skipping = SkippingSampler(sampler)
        self.loader = DataLoader(
            dataset, batch_size=batch_size, sampler=self.skipping,
            num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
        )

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        return self.iterate()

    def iterate(self, skip_batches=0, seed=None):
        """This epoch's batches after the first ``skip_batches``. ``seed`` seeds the loader's
        own generator, so that starting the epoch draws nothing from the training's random
        stream. It also seeds the workers when they start: in the first epoch this process
        trains (they live on, with their streams, through the epochs after it)."""
        self.skipping.skip = skip_batches * self.batch_size
        self.loader.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return iter(self.loader)

    @property
    def order(self):
        return self.skipping.order

    def sample_inputs(self, count=2):
        """A few inputs, with the random numbers of their transforms drawn aside from the run's."""
        with torch.random.fork_rng(devices=[]):
            return torch.stack([self.dataset[i][0] for i in range(count)])
