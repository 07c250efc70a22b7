"""Download what the course can train on into data/ (run once, on a login node).

    python scripts/tools/download_data.py {mnist,cifar10,hymenoptera,resnet18-weights,all} [--data-dir DIR]

    mnist              the full MNIST (data/MNIST/)
    cifar10            CIFAR-10 (data/cifar-10-batches-py/), for --dataset cifar10
    hymenoptera        the ants and bees of PyTorch's transfer-learning tutorial
                       (data/hymenoptera_data/ with train/ and val/), for step6_finetune.py
    resnet18-weights   torchvision's ImageNet weights for ResNet-18, into the torch hub
                       cache, where step6_finetune.py --pretrained reads them; or, with
                       --weights-file FILE, into FILE (then pass --weights FILE)

Compute nodes often have no internet, so run this on the login node (or any machine
with internet, then copy data/ over). Training scripts then read the data with
download=False. The torch hub cache is $TORCH_HOME/hub (by default ~/.cache/torch/hub):
on a cluster, home directories are usually seen by every node; if yours is not, use
--weights-file on a shared file system. This is a plain single-process script: never
start it under torchrun or srun with several ranks, since parallel downloads into one
folder race and corrupt each other's files. Without it, the course uses the bundled
subset in data/mnist5k/.
"""
import argparse
import os
import re
import socket
import sys
from pathlib import Path

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "data"
NAMES = ["mnist", "cifar10", "hymenoptera", "resnet18-weights"]
# The ants and bees as PyTorch's transfer-learning tutorial downloads them.
HYMENOPTERA_URL = "https://download.pytorch.org/tutorial/hymenoptera_data.zip"
HYMENOPTERA_FOLDER = "hymenoptera_data"  # what the zip file holds; kit/datasets.py reads it there


def resnet18_weights_url():
    from torchvision.models import ResNet18_Weights

    return ResNet18_Weights.IMAGENET1K_V1.url


def destination(name, args):
    """Where NAME goes: the folder or file the training scripts read it from."""
    if name == "mnist":
        return args.data_dir / "MNIST"
    if name == "cifar10":
        return args.data_dir / "cifar-10-batches-py"
    if name == "hymenoptera":
        return args.data_dir / HYMENOPTERA_FOLDER
    if args.weights_file is not None:
        return args.weights_file
    import torch

    # torch.hub's own place for downloaded weights, the one torchvision's weights= reads
    return Path(torch.hub.get_dir()) / "checkpoints" / resnet18_weights_url().rsplit("/", 1)[-1]


def download_dataset(name, data_dir):
    import torchvision  # imported here so --help is instant

    dataset_class = {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10}[name]
    for train in (True, False):
        dataset = dataset_class(root=data_dir, train=train, download=True)
        print(f"{name}: {len(dataset)} {'train' if train else 'test'} images")


def download_hymenoptera(data_dir):
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(HYMENOPTERA_URL, download_root=data_dir, remove_finished=True)
    for split in ("train", "val"):
        classes = sorted(path.name for path in (data_dir / HYMENOPTERA_FOLDER / split).iterdir() if path.is_dir())
        print(f"hymenoptera: {split}/ with the classes {', '.join(classes)}")


def download_weights(path):
    import torch

    url = resnet18_weights_url()
    # torchvision names its files <model>-<first hex digits of the SHA-256>.pth; torch checks them
    hash_prefix = re.search(r"-([a-f0-9]+)\.", url.rsplit("/", 1)[-1])[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.hub.download_url_to_file(url, str(path), hash_prefix=hash_prefix)


def download(name, args):
    """Fetch NAME unless it is there already; return where it is."""
    where = destination(name, args)
    if name in ("hymenoptera", "resnet18-weights") and where.exists():
        print(f"{name} is there already ({where}); delete it to download it again")
        return where
    if name == "hymenoptera":
        download_hymenoptera(args.data_dir)
    elif name == "resnet18-weights":
        download_weights(where)
    else:
        download_dataset(name, args.data_dir)
    return where


def short_reason(error: Exception) -> str:
    # torchvision's MNIST error is several lines (one per mirror); its last line is the last mirror's error.
    last_line = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return last_line.removeprefix("<urlopen error ").removesuffix(">")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", metavar="{" + ",".join(NAMES + ["all"]) + "}", nargs="+", choices=NAMES + ["all"],
                        help="what to download (several names, or all)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help=f"default: {DEFAULT_DATA_DIR}")
    parser.add_argument("--weights-file", type=Path, default=None,
                        help="resnet18-weights: save them as this file instead of in the torch hub cache")
    args = parser.parse_args(argv)
    if args.weights_file is not None and args.weights_file.is_dir():
        parser.error(f"--weights-file {args.weights_file} is a folder; "
                     f"name a file, e.g. {args.weights_file}/resnet18.pth")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("error: run this script once, not under torchrun with several ranks")

    # urllib waits forever on a silently dropped connection; fail instead (per socket operation, not per file).
    socket.setdefaulttimeout(30)
    names = NAMES if "all" in args.what else list(dict.fromkeys(args.what))
    for name in names:
        try:
            location = download(name, args)
        except (OSError, RuntimeError) as error:  # URLError is an OSError; torchvision wraps failures in RuntimeError
            print(f"error: could not download {name} ({short_reason(error)}); run this on a machine with "
                  "internet (e.g. the login node) and copy data/ over", file=sys.stderr)
            sys.exit(1)
        print(f"{name} is in {location.resolve()}")
    if "resnet18-weights" in names and args.weights_file is not None:
        print(f"train with: torchrun --nproc-per-node=2 scripts/step6_finetune.py --weights {args.weights_file}")


if __name__ == "__main__":
    main()
