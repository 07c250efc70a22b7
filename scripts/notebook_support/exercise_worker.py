"""The processes of an exercise's check: notebook_support.exercises.in_processes starts this script under torchrun.
Notebook support: a learner may skip this module.

Each process joins a gloo group, then for each answer the kernel wrote (answer0.py, answer1.py, ...) runs the
exercise's rank check on it and writes its verdicts so far to rank<R>.json in the folder: a rank that dies leaves
the verdicts it reached, and one whose answer does not return within ANSWER_SECONDS writes that and ends.
"""
import argparse
import datetime
import importlib
import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from notebook_support.exercises.in_processes import (  # noqa: E402
    ANSWER_SECONDS,
    HUNG,
    TIMEOUT_SECONDS,
    Wrong,
    frames_of_the_answer,
    load_answer,
    raised_line,
)


def verdict(rank_check, answer_path, work):
    """[problem or None, detail]: the rank check's one line, or what the participant's code raised, in one line."""
    try:
        return [None, rank_check(load_answer(answer_path), work)]
    except Exception as error:  # noqa: BLE001 (the participant's code may raise anything: say what, in one line)
        if isinstance(error, Wrong) or (isinstance(error, AssertionError) and not frames_of_the_answer(error)):
            return [str(error), None]  # the check's verdict
        return [raised_line(error, dist.get_rank()), None]


def give_up_after(seconds, results, report):
    """End this process if the answer has not returned after ``seconds``, with a verdict that says so: a loop
    that never ends would otherwise hold the check (and the machine's cores) until the kernel's limit. Returns
    ``finish(outcome)``, which records the answer's own verdict unless the watchdog has already ended it."""
    lock, state = threading.Lock(), {"done": False}

    def give_up():
        with lock:
            if state["done"]:
                return
            results.append([f"rank {dist.get_rank()}: {HUNG} {seconds:g} s: a loop that never ends, or a wait for "
                            "something that never comes", None])
            report(results)
            os._exit(3)

    def finish(outcome):
        with lock:
            state["done"] = True
            timer.cancel()
            results.append(outcome)
            report(results)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    return finish


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", required=True, help="module:function of the rank check")
    parser.add_argument("--answers", type=int, required=True, help="how many answer files to run, in turn")
    parser.add_argument("--folder", type=Path, required=True, help="where the answers are and the verdicts go")
    parser.add_argument("--answer-seconds", type=float, default=ANSWER_SECONDS,
                        help="how long one answer may run before this process ends it")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes share the cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
    module, name = args.check.split(":")
    rank_check = getattr(importlib.import_module(module), name)
    results, path = [], args.folder / f"rank{dist.get_rank()}.json"

    def report(verdicts):
        path.write_text(json.dumps(verdicts))

    for number in range(args.answers):
        work = args.folder / f"work{number}"  # a folder of its own, for the files an answer writes
        work.mkdir(exist_ok=True)
        finish = give_up_after(args.answer_seconds, results, report)
        finish(verdict(rank_check, args.folder / f"answer{number}.py", work))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
