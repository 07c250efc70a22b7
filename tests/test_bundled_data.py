"""The bundled MNIST subset in data/mnist5k/ is intact, loads with torchvision, and is split cleanly."""
import hashlib
import re
from pathlib import Path

import pytest
import torch
import torchvision

from helpers import SHORT_TEST_IMAGES, SHORT_TEST_SPLIT_DIR

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
ROOT = DATA_DIR / "mnist5k"
RAW_DIR = ROOT / "MNIST" / "raw"
IDX_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def recorded_sha256() -> dict[str, str]:
    """The sha256 table in data/README.md is the one source of truth: rows like | `file` | bytes | `sha256` |."""
    row = re.compile(r"^\|\s*`([\w-]+-idx[13]-ubyte)`\s*\|.*\|\s*`([0-9a-f]{64})`\s*\|\s*$")
    lines = (DATA_DIR / "README.md").read_text().splitlines()
    return dict(match.groups() for match in map(row.match, lines) if match)


@pytest.fixture(scope="module")
def splits():
    return {train: torchvision.datasets.MNIST(ROOT, train=train, download=False) for train in (True, False)}


def test_readme_records_every_file():
    assert sorted(recorded_sha256()) == sorted(IDX_FILES)


@pytest.mark.parametrize("name", IDX_FILES)
def test_file_matches_recorded_sha256(name):
    assert hashlib.sha256((RAW_DIR / name).read_bytes()).hexdigest() == recorded_sha256()[name]


def test_torchvision_loads_4000_train_and_1000_test(splits):
    for train, expected_count in [(True, 4000), (False, 1000)]:
        images = splits[train].data
        assert images.shape == (expected_count, 28, 28)
        assert images.dtype == torch.uint8


def test_every_class_is_split_80_20(splits):
    train_counts = torch.bincount(splits[True].targets, minlength=10)
    test_counts = torch.bincount(splits[False].targets, minlength=10)
    assert len(train_counts) == len(test_counts) == 10
    assert (train_counts > 0).all() and (test_counts > 0).all()
    expected_test = 0.2 * (train_counts + test_counts)
    assert ((test_counts - expected_test).abs() <= 1).all(), (train_counts.tolist(), test_counts.tolist())


def test_no_test_image_is_also_in_train(splits):
    train_images = {image.numpy().tobytes() for image in splits[True].data}
    leaked = [i for i, image in enumerate(splits[False].data) if image.numpy().tobytes() in train_images]
    assert leaked == [], f"test images also in train: {leaked[:10]}"


def test_the_short_test_split_is_the_bundled_one_cut_short(splits):
    """helpers.SHORT_TEST_SPLIT, the data of the tests' drill runs: the same training images, and the first test
    images, as torchvision reads them."""
    short = {train: torchvision.datasets.MNIST(SHORT_TEST_SPLIT_DIR / "mnist5k", train=train, download=False)
             for train in (True, False)}
    assert torch.equal(short[True].data, splits[True].data) and torch.equal(short[True].targets, splits[True].targets)
    assert len(short[False]) == SHORT_TEST_IMAGES < len(splits[False])
    assert torch.equal(short[False].data, splits[False].data[:SHORT_TEST_IMAGES])
    assert torch.equal(short[False].targets, splits[False].targets[:SHORT_TEST_IMAGES])
