"""Download the full MNIST and/or CIFAR-10 into data/ (run once, on a login node).

    python scripts/download_data.py {mnist,cifar10,all} [--data-dir DIR]

Compute nodes often have no internet, so run this on the login node (or any machine
with internet, then copy data/ over). Training scripts then read the data with
download=False. This is a plain single-process script: never start it under torchrun
or srun with several ranks, since parallel downloads into one folder race and corrupt
each other's files. Without it, the course uses the bundled subset in data/mnist5k/.
"""
import argparse
import os
import socket
import sys
from pathlib import Path

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def download(name: str, data_dir: Path) -> Path:
    import torchvision  # imported here so --help is instant

    dataset_class = {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10}[name]
    for train in (True, False):
        dataset = dataset_class(root=data_dir, train=train, download=True)
        print(f"{name}: {len(dataset)} {'train' if train else 'test'} images")
    return data_dir / ("MNIST" if name == "mnist" else "cifar-10-batches-py")


def short_reason(error: Exception) -> str:
    # torchvision's MNIST error is several lines (one per mirror); its last line is the last mirror's error.
    last_line = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return last_line.removeprefix("<urlopen error ").removesuffix(">")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=["mnist", "cifar10", "all"])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help=f"default: {DEFAULT_DATA_DIR}")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("error: run this script once, not under torchrun with several ranks")

    # urllib waits forever on a silently dropped connection; fail instead (per socket operation, not per file).
    socket.setdefaulttimeout(30)
    for name in ["mnist", "cifar10"] if args.dataset == "all" else [args.dataset]:
        try:
            location = download(name, args.data_dir)
        except (OSError, RuntimeError) as error:  # URLError is an OSError; torchvision wraps failures in RuntimeError
            print(f"error: could not download {name} ({short_reason(error)}); run this on a machine with "
                  "internet (e.g. the login node) and copy data/ over", file=sys.stderr)
            sys.exit(1)
        print(f"{name} is in {location.resolve()}")


if __name__ == "__main__":
    main()
