"""Run the whole course path on this machine and print one table to compare the steps.

    python scripts/tools/run_course.py              # what `make run` does
    python scripts/tools/run_course.py --epochs 5 --dataset mnist

Steps: one process; gradients averaged by hand (per parameter, then one bucket);
DataParallel; DDP. The distributed steps use every local GPU, or 2 processes on a
machine without one. --batch-size is per process, as in every script, so the
distributed steps train with a larger global batch (the "batch" column).
Extra arguments after `--` go to every step.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch

from machinery import cli
from notebook_support.runs import python, read_record, torchrun

STEPS = [  # (label, script, launched by torchrun?, extra arguments)
    ("1 one process", "step1_baseline.py", False, ()),
    ("2 all_reduce per-parameter", "step2_allreduce.py", True, ("--mode", "per-parameter")),
    ("2 all_reduce bucket", "step2_allreduce.py", True, ("--mode", "bucket")),
    ("3 DataParallel", "step3_data_parallel.py", False, ()),
    ("4 DDP", "step4_ddp.py", True, ()),
]


def run_step(label, script, distributed, extra, args, index):
    run_name = f"step{index}-{script.removesuffix('.py')}"
    common = ("--epochs", args.epochs, "--results-dir", args.results_dir, "--run-name", run_name,
              "--checkpoint-dir", Path(args.results_dir) / "checkpoints" / run_name, *extra, *args.rest)
    print(f"\n=== step {label} ===", flush=True)
    if distributed:
        torchrun(script, *common, nproc=args.nproc)
    else:
        python(script, *common)
    return read_record(args.results_dir, run_name)


def table(rows):
    header = (f"{'step':<28}{'procs':>6}{'device':>8}{'batch':>7}{'s/epoch':>9}{'samples/s':>11}"
              f"{'total s':>9}{'test acc':>10}")
    lines = [header, "-" * len(header)]
    for label, record in rows:
        epochs = record["per_epoch"]
        seconds = sum(e["seconds"] for e in epochs) / len(epochs)
        throughput = sum(e["samples_per_second"] for e in epochs) / len(epochs)
        lines.append(f"{label:<28}{record['world_size']:>6}{record['device'].split(':')[0]:>8}"
                     f"{record['global_batch_size']:>7}{seconds:>9.2f}"
                     f"{throughput:>11,.0f}{record['total_seconds']:>9.1f}{record['final_test_accuracy']:>10.2%}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=cli.positive_int, default=3)
    parser.add_argument("--nproc", type=cli.positive_int, default=torch.cuda.device_count() or 2,
                        help="processes for the distributed steps (default: every GPU, or 2 on CPU)")
    parser.add_argument("--results-dir", default=str(cli.default_results_dir() / "course"),
                        help=f"where every step's record and checkpoints go (default: results/course/, in "
                             f"${cli.OUTPUT_DIR_VARIABLE} if set)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="after --: arguments for every step")
    args = parser.parse_args()
    args.rest = [a for a in args.rest if a != "--"]
    rows = [(label, run_step(label, script, dist, extra, args, i + 1))
            for i, (label, script, dist, extra) in enumerate(STEPS)]
    print("\n" + table(rows))


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:  # a step failed: its output is above
        raise SystemExit(f"error: {error}") from None
