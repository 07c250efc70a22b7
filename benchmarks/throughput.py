"""Benchmark: training throughput of the course's steps on this machine.

    python benchmarks/throughput.py --repeats 3

Runs, alternating within each repeat so that a busy moment hits every variant alike:
  one process, all cores      train_single.py with --threads = the cores (the fair baseline)
  all_reduce per-parameter    train_allreduce.py, N processes
  all_reduce bucket           train_allreduce.py --mode bucket, N processes
  DDP                         train_ddp.py, N processes
N is every GPU, or 2 on a CPU machine (one thread each). Throughput is the median,
over repeats, of the last epoch's samples/s (the first epoch pays for warm-up).
The numbers and the hardware go to a JSON file under benchmarks/results/.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
import torch  # noqa: E402

from core.notebook import python, read_record, torchrun  # noqa: E402


def variants(nproc, cores):
    return {
        f"one process, {cores} threads": (False, "train_single.py", ("--threads", cores)),
        f"all_reduce per-parameter, {nproc} processes": (True, "train_allreduce.py", ("--mode", "per-parameter")),
        f"all_reduce bucket, {nproc} processes": (True, "train_allreduce.py", ("--mode", "bucket")),
        f"DDP, {nproc} processes": (True, "train_ddp.py", ()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / f"throughput-{time.strftime('%Y%m%d')}.json")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    table = variants(args.nproc, cores)
    samples = {name: [] for name in table}
    hardware = None
    with tempfile.TemporaryDirectory() as results:
        for repeat in range(args.repeats):
            for name, (distributed, script, extra) in table.items():
                common = ("--epochs", args.epochs, "--results-dir", results, "--run-name", "run", *extra)
                if distributed:
                    torchrun(script, *common, nproc=args.nproc, echo=False)
                else:
                    python(script, *common, echo=False)
                record = read_record(results, "run")
                hardware = hardware or record["hardware"]
                samples[name].append(record["per_epoch"][-1]["samples_per_second"])
                print(f"repeat {repeat + 1}: {name:<40} {samples[name][-1]:8,.0f} samples/s", flush=True)
    baseline = statistics.median(next(iter(samples.values())))
    print(f"\nmedian of {args.repeats}, {hardware['cpu']}, {cores} cores, torch {hardware['torch']}:")
    summary = {}
    for name, values in samples.items():
        median = statistics.median(values)
        summary[name] = {"samples_per_second": median, "vs_one_process": median / baseline, "runs": values}
        print(f"  {name:<40} {median:8,.0f} samples/s  {median / baseline:5.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"hardware": hardware, "cores": cores, "epochs": args.epochs,
                                    "repeats": args.repeats, "results": summary}, indent=2) + "\n")
    print(f"written to benchmarks/results/{args.out.name}")


if __name__ == "__main__":
    main()
