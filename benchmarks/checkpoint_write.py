"""How long a checkpoint takes to write: the Net's and ResNet-18's, with Adam's state, as the course writes them.

    python benchmarks/checkpoint_write.py --records benchmarks/results

Builds each model (10 classes), gives Adam its state with one step on zero gradients (the step count and the
two moving averages per weight), and writes ``{"model": ..., "optimizer": ...}`` with
``kit.checkpoints.write_atomically`` (serialized, written, fsync'ed, renamed, the folder fsync'ed) into
--folder, --repeats times each, after one write not counted. The record keeps every time, the checkpoint's size,
the folder's file system and the load average: a stop by signal must fit a checkpoint between SIGTERM and
SIGKILL (docs/running_on_a_cluster.md, "Grace periods, and what a checkpoint costs").
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repository root, not this folder, goes on sys.path (__init__.py)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from kit import checkpoints  # noqa: E402
from lesson import models  # noqa: E402

MODELS = {"net": models.Net, "resnet18": models.MODELS["resnet18"]}


def checkpoint_state(name):
    torch.manual_seed(0)
    model = MODELS[name](num_classes=10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # Adam's state exists from its first step on
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def file_system(folder):
    """The type of the file system that holds ``folder`` (the longest matching mount point in /proc/mounts)."""
    folder, best = str(Path(folder).resolve()), ("", "unknown")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best[1]
    for line in lines:
        _, mount, kind, *_ = line.split()
        if (folder == mount or folder.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
            best = (mount, kind)
    return best[1]


def time_writes(state, folder, repeats):
    path = folder / f".checkpoint-write-benchmark-{os.getpid()}.pt"
    try:
        checkpoints.write_atomically(state, path)  # not counted: first allocations, a cold page cache
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            checkpoints.write_atomically(state, path)
            seconds.append(time.perf_counter() - started)
        return path.stat().st_size, seconds
    finally:
        path.unlink(missing_ok=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--folder", type=Path, default=common.REPO / "checkpoints",
                        help="where to write (default: checkpoints/, where the course's runs write theirs)")
    parser.add_argument("--records", type=Path, default=common.DEFAULT_RECORDS)
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    load_before = common.load_average()
    rows = []
    for name in MODELS:
        size, seconds = time_writes(checkpoint_state(name), args.folder, args.repeats)
        rows.append({"model": name, "bytes": size, "seconds": [round(s, 4) for s in seconds]})
        print(f"{name:9} {size / 1e6:6.1f} MB  {min(seconds):.2f} to {max(seconds):.2f} s, "
              f"median {statistics.median(seconds):.2f} s ({args.repeats} writes)", flush=True)
    record = {"benchmark": "checkpoint_write", "hardware": common.hardware(), "file_system": file_system(args.folder),
              "repeats": args.repeats, "load_average": [load_before, common.load_average()], "models": rows}
    print(f"file system {record['file_system']}, load average {record['load_average'][0]} before, "
          f"{record['load_average'][1]} after")
    common.write_record(args.records, "checkpoint_write", record)


if __name__ == "__main__":
    main()
