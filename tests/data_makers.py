"""Data the tests make for themselves, since none of it can be downloaded here.

- ``write_cifar10``: CIFAR-10 as torchvision reads it from disk: cifar-10-batches-py/ with
  the five pickled training batches, the test batch and batches.meta, in the layout of the
  real files (rows of 3,072 bytes: the red plane, then green, then blue), with few images.
  torchvision's CIFAR10 checks every file's md5 sum against the real set's, which a file
  written here can never match. So a test that trains on these files starts the script
  through ``accepting_any_md5``: a launcher that replaces that one check (torchvision's
  ``datasets.cifar.check_integrity``) by "the file exists", then runs the course's script
  unchanged. Everything else is torchvision's real code: the pickles read, the layout
  turned to HWC, the class names read from batches.meta. (``torchvision.datasets.FakeData``
  would replace the data set class itself, leaving none of that reading code tested.)
  The synthetic-cifar10 data set (scripts/kit/datasets.py) covers the CIFAR-shaped path where no
  launcher can be slipped in, as in the cluster jobs.
- ``write_image_folder``: a real ImageFolder (train/ and val/, one folder per class, PNG
  files) from the bundled MNIST digits: two classes, zeros and ones.
- ``write_resnet18_weights``: the state_dict of a ResNet-18 built here, with ImageNet's
  1,000-class head, as a stand-in for torchvision's pretrained file.
- ``write_mnist5k_with_a_short_test_split``: the bundled MNIST subset with its training split
  whole and its test split cut to its first images, in the same IDX files.
"""
import pickle
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import datasets
from torchvision.models import resnet18

REPO = Path(__file__).resolve().parents[1]
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

ACCEPTING_ANY_MD5 = '''"""Run a course script with torchvision's CIFAR-10 md5 check accepting any file that exists."""
import os
import runpy
import sys

import torchvision.datasets.cifar as cifar

cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)
script = sys.argv.pop(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # what running the script itself would put first
runpy.run_path(script, run_name="__main__")
'''


def cifar10_images(count, seed):
    """``count`` images (rows of 3,072 bytes, as in CIFAR's files) and labels: each image its
    class's colour plus noise, so that a model can learn them."""
    generator = np.random.default_rng(seed)
    labels = generator.integers(0, 10, count)
    colours = np.random.default_rng(0).integers(0, 256, (10, 3, 1))
    noise = generator.integers(-40, 41, (count, 3, 1024))
    images = np.clip(colours[labels] + noise, 0, 255).astype(np.uint8).reshape(count, 3072)
    return images, labels.tolist()


def write_cifar10(root, per_batch=40, test_images=40, seed=0):
    """cifar-10-batches-py/ under ``root`` with 5 x ``per_batch`` training images and
    ``test_images`` test images; returns ``root`` (the --data-dir to pass)."""
    folder = Path(root) / datasets.CIFAR10.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    batches = [(name, per_batch) for name, _ in datasets.CIFAR10.train_list] + [("test_batch", test_images)]
    for index, (name, count) in enumerate(batches):
        images, labels = cifar10_images(count, seed + index)
        entry = {"batch_label": name.encode(), "labels": labels, "data": images,
                 "filenames": [f"{name}_{i}.png".encode() for i in range(count)]}
        with open(folder / name, "wb") as file:
            pickle.dump(entry, file, protocol=2)
    with open(folder / datasets.CIFAR10.meta["filename"], "wb") as file:
        pickle.dump({"label_names": CIFAR10_CLASSES, "num_cases_per_batch": per_batch, "num_vis": 3072}, file,
                    protocol=2)
    return Path(root)


def accepting_any_md5(folder):
    """A launcher for ``python LAUNCHER SCRIPT ARGS...`` (or under torchrun) that runs SCRIPT
    with torchvision's CIFAR-10 md5 check accepting the files written by ``write_cifar10``."""
    path = Path(folder) / "accepting_any_md5.py"
    path.write_text(ACCEPTING_ANY_MD5)
    return path


def write_image_folder(root, train_per_class=8, val_per_class=4, digits=(0, 1), names=("zero", "one")):
    """train/ and val/ under ``root``, a folder per class of PNG images of the bundled MNIST
    digits (the first images of each digit in the bundled training split)."""
    mnist = datasets.MNIST(REPO / "data" / "mnist5k", train=True, download=False)
    for digit, name in zip(digits, names):
        images = mnist.data[mnist.targets == digit][:train_per_class + val_per_class].numpy()
        for split, chosen in (("train", images[:train_per_class]), ("val", images[train_per_class:])):
            (Path(root) / split / name).mkdir(parents=True, exist_ok=True)
            for index, image in enumerate(chosen):
                Image.fromarray(image).save(Path(root) / split / name / f"{name}_{index}.png")
    return Path(root)


def write_resnet18_weights(path, seed=1):
    """A ResNet-18's state_dict with the 1,000-class ImageNet head, seeded: a stand-in for
    torchvision's pretrained file, whose every value a test can compare."""
    torch.manual_seed(seed)
    state = resnet18(num_classes=1000).state_dict()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


def write_mnist5k_with_a_short_test_split(root, test_images):
    """mnist5k/MNIST/raw/ under ``root``: the bundled training files as they are and the first
    ``test_images`` of the bundled test split (IDX files: a big-endian header whose second number
    is the count, then one record per item); returns ``root`` (the --data-dir to pass)."""
    bundled, raw = REPO / "data" / "mnist5k" / "MNIST" / "raw", Path(root) / "mnist5k" / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        shutil.copyfile(bundled / name, raw / name)
    for name, header, record in (("t10k-images-idx3-ubyte", 16, 28 * 28), ("t10k-labels-idx1-ubyte", 8, 1)):
        whole = (bundled / name).read_bytes()
        (raw / name).write_bytes(whole[:4] + struct.pack(">I", test_images) + whole[8:header] +
                                 whole[header:header + test_images * record])
    return Path(root)


if __name__ == "__main__":  # python tests/data_makers.py FOLDER: the ImageFolder and weights, for a job to use
    target = Path(sys.argv[1])
    write_image_folder(target / "imagefolder")
    write_resnet18_weights(target / "resnet18-weights.pt")
    print(f"wrote {target / 'imagefolder'} and {target / 'resnet18-weights.pt'}")
