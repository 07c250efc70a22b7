"""The models beyond the Net: with BatchNorm, and ResNet-18 two ways. Kit: a learner may skip this module (notebooks 06
and 07 use these models).

    --model net-bn           the Net with BatchNorm, for SyncBatchNorm (1x28x28 images)
    --model resnet18         torchvision's ResNet-18 (colour images, any size)
    --model resnet18-cifar   ResNet-18 with the usual CIFAR stem (colour images, any size)

Which stem for CIFAR-10, and why. torchvision's ResNet-18 was made for 224x224 ImageNet
images: its stem, a 7x7 convolution with stride 2 and a max-pool, shrinks an image 4x in
each direction before the first residual block, so a 32x32 CIFAR image reaches the last
block as 1x1. That is the model the Palmetto cluster's DDP tutorial (clemsonciti/palmetto-examples)
trains on CIFAR-10 and the one ImageNet weights fit, and ``--model resnet18`` is exactly that. The
usual CIFAR stem, a 3x3 convolution with stride 1 and no max-pool, keeps all 32x32 pixels through
the first block; it is the common choice for training on CIFAR-10 from scratch, at about 15x the
compute per image (tests/test_real_models.py counts both). The course's CPU runs use the cheaper
model; on GPUs, ``--model resnet18-cifar`` gives DDP more computation per step to overlap with its
communication.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import datasets, sync_batchnorm
from .errors import CourseError


class NetBN(nn.Module):
    """The Net with BatchNorm after each convolution: a small model whose training depends on
    the statistics of the batch, for SyncBatchNorm (``--model net-bn --sync-bn``).

    The convolutions have no bias: BatchNorm subtracts the mean right after them, which
    would cancel any bias, and adds its own.
    """

    def __init__(self, dropout=True, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(64)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


def resnet18(dropout=True, num_classes=10):
    """torchvision's ResNet-18 with ``num_classes`` outputs (it has no dropout to turn off)."""
    from torchvision.models import resnet18 as torchvision_resnet18  # imported when used: datasets.py says why

    return torchvision_resnet18(num_classes=num_classes)


def resnet18_cifar(dropout=True, num_classes=10):
    """ResNet-18 with the CIFAR stem: a 3x3 convolution, stride 1, and no max-pool."""
    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits its convs
    model.maxpool = nn.Identity()
    return model


MODELS = {"net-bn": NetBN, "resnet18": resnet18, "resnet18-cifar": resnet18_cifar}  # lesson/models.py adds the Net
# The images each model takes, (channels, height, width); None: any size.
INPUTS = {"net": (1, 28, 28), "net-bn": (1, 28, 28), "resnet18": (3, None, None), "resnet18-cifar": (3, None, None)}


def check_choice(model, dataset):
    """A one-line error for a model the course does not have, or one that cannot take the data set's images."""
    if model not in INPUTS:
        raise CourseError(f"unknown --model {model!r}; choose one of: {', '.join(INPUTS)}")
    check_fits(model, dataset)


def check_fits(model, dataset):
    """A one-line error when the data set's images are not what the model takes."""
    takes, shape = INPUTS[model], datasets.IMAGE_SHAPES.get(dataset)
    if shape is None or all(t in (None, s) for t, s in zip(takes, shape)):
        return
    fitting = [name for name, other in INPUTS.items() if all(t in (None, s) for t, s in zip(other, shape))]
    channels, height, width = takes
    described = f"{channels}x{height}x{width} images" if height else f"{channels}-channel images of any size"
    raise CourseError(f"--model {model} takes {described}, and --dataset {dataset} has {'x'.join(map(str, shape))}; "
                      f"use --model {' or '.join(fitting)} for it")


def with_sync_batchnorm(model, name, sync_bn, device):
    """With ``--sync-bn``, the model's BatchNorm layers become SyncBatchNorm (kit/sync_batchnorm.py):
    PyTorch's when the run will use a GPU (``device``, as --device gives it), the course's CPU version otherwise."""
    if not sync_bn:
        return model
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return sync_batchnorm.convert(model, name, on_gpu=on_gpu)
