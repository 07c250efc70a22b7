"""The exit hook that counts the gloo threads each rank still has when it exits (tests/test_teardown.py says
why that count matters): a ``sitecustomize`` on PYTHONPATH registers it with ``atexit`` in every process."""
import json
import os
from pathlib import Path

import pytest

from helpers import script_env

COUNTS_THREADS_IN_PROC = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                            reason="counts threads in /proc (Linux)")

EXIT_HOOK = """
import atexit, json, os

def _thread_name(task):
    try:
        with open(f"/proc/self/task/{task}/comm") as comm:
            return comm.read().strip()
    except OSError:  # the thread ended between the listing and this read: it is not left at exit
        return ""

def _gloo_threads_at_exit():
    if "RANK" not in os.environ or not os.path.isdir("/proc/self/task"):
        return
    names = [_thread_name(task) for task in os.listdir("/proc/self/task")]
    with open(os.environ["EXIT_REPORT"], "a") as report:
        report.write(json.dumps({"rank": int(os.environ["RANK"]),
                                 "gloo_threads": sum(n.startswith(("pt_gloo", "gloo")) for n in names)}) + "\\n")

atexit.register(_gloo_threads_at_exit)
"""


def exit_report_in(folder):
    """The report exit_env(folder)'s hook writes: a line per rank that exited."""
    return folder / "exit.jsonl"


def exit_env(tmp_path, automatic_gc=True):
    """script_env with the hook: each rank that exits adds its count to the report (returned with it).
    ``automatic_gc=False``: Python's cycle collector never runs by itself in the script (gc.disable())."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(("" if automatic_gc else "import gc\ngc.disable()\n") + EXIT_HOOK)
    report = exit_report_in(tmp_path)
    return script_env(PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
                      EXIT_REPORT=report), report


def gloo_threads_at_exit(report):
    return sorted((entry["rank"], entry["gloo_threads"]) for entry in map(json.loads, report.read_text().splitlines()))
