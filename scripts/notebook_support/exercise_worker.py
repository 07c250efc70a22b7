"""The processes of an exercise's check: notebook_support.exercises.in_processes starts this script under torchrun.
Notebook support: a learner may skip it.

Each process joins a gloo group, then for each answer the kernel wrote (answer0.py, answer1.py, ...) runs the
exercise's rank check on it and writes its verdicts so far to rank<R>.json in the folder: a rank that hangs or dies
leaves the verdicts it reached.
"""
import argparse
import datetime
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from notebook_support.exercises.in_processes import TIMEOUT_SECONDS, load_answer  # noqa: E402


def verdict(rank_check, answer_path, work):
    """[problem or None, detail]: the rank check's one line, or what the participant's code raised."""
    try:
        return [None, rank_check(load_answer(answer_path), work)]
    except AssertionError as wrong:
        return [str(wrong), None]
    except Exception as error:  # noqa: BLE001 (the participant's code may raise anything: say what, in one line)
        message = (str(error).strip().splitlines() or [""])[0]
        return [f"rank {dist.get_rank()}: your code raised {type(error).__name__}: {message}", None]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", required=True, help="module:function of the rank check")
    parser.add_argument("--answers", type=int, required=True, help="how many answer files to run, in turn")
    parser.add_argument("--folder", type=Path, required=True, help="where the answers are and the verdicts go")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes share the cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
    module, name = args.check.split(":")
    rank_check = getattr(importlib.import_module(module), name)
    results = []
    for number in range(args.answers):
        work = args.folder / f"work{number}"  # a folder of its own, for the files an answer writes
        work.mkdir(exist_ok=True)
        results.append(verdict(rank_check, args.folder / f"answer{number}.py", work))
        (args.folder / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
