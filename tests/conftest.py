"""Fixtures only; what the tests share besides is in helpers.py."""
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def results_dir(tmp_path):
    return tmp_path / "results"


@pytest.fixture(scope="session", autouse=True)
def short_test_split():
    """The files of helpers.SHORT_TEST_SPLIT, written before this process's first test."""
    from data_makers import write_mnist5k_with_a_short_test_split
    from helpers import SHORT_TEST_IMAGES, SHORT_TEST_SPLIT_DIR  # once conftest.py at the top set COURSE_OUTPUT_DIR

    write_mnist5k_with_a_short_test_split(SHORT_TEST_SPLIT_DIR, SHORT_TEST_IMAGES)


@contextlib.contextmanager
def held(lock_path):
    """An exclusive lock on ``lock_path`` (created if missing), held until the block ends: the xdist workers of
    one session take turns."""
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def made_once(name, make):
    """The folder ``name`` in the session's output folder, which every xdist worker shares, after ``make(folder)``
    has filled it once for the whole session: the first test process to get here calls it, the others wait for
    the lock and then find it made. If ``make`` failed, they fail at once instead of making it again into the
    half-written folder."""
    shared = Path(os.environ["COURSE_OUTPUT_DIR"])
    folder = shared / name
    finished, failed = shared / f"{name}.finished", shared / f"{name}.failed"
    with held(shared / f"{name}.lock"):
        if failed.exists():
            pytest.fail(f"{name}: made in another test process, where it failed: that process's report shows why")
        if not finished.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a maker killed midway (no marker) left
            try:
                make(folder)
            except BaseException:
                failed.touch()
                raise
            finished.touch()
    return folder


def saved_run(done, path):
    """A finished process written to ``path``, for the test processes that did not start it (read_run)."""
    path.write_text(json.dumps({"args": done.args, "returncode": done.returncode, "stdout": done.stdout,
                                "stderr": done.stderr}))


def read_run(path):
    return subprocess.CompletedProcess(**json.loads(path.read_text()))


@pytest.fixture(scope="session")
def uninterrupted():
    """The reference runs of helpers.RESUMABLE_RUN, never interrupted: DDP in 2 processes, and the single-process
    baseline, which also shows the pruning of old checkpoints (--keep-checkpoints 2, a setting that changes no
    weight). test_checkpoints.py and test_graceful_stop.py compare their killed, stopped and resumed runs with
    them, trained once for the session (made_once)."""
    from helpers import RESUMABLE_RUN, assert_ok, read_json, run_outputs, run_python, run_torchrun, saved_weights

    def train(folder):
        assert_ok(run_torchrun("step4_ddp.py", *RESUMABLE_RUN, *run_outputs(folder, "ddp")))
        assert_ok(run_python("step1_baseline.py", *RESUMABLE_RUN, "--keep-checkpoints", 2,
                             *run_outputs(folder, "single")))

    folder = made_once("uninterrupted-runs", train)
    return {"ddp": saved_weights(folder, "ddp"), "single": saved_weights(folder, "single"),
            "ddp_record": read_json(folder / "results" / "ddp.json"), "folder": folder}


@pytest.fixture(scope="session")
def beyond_demo_run():
    """``beyond_demo_run(group)``: the run of scripts/demos/beyond_ddp.py with the demos of that group of
    helpers.BEYOND_DEMO_GROUPS, made once for the session (made_once): test_beyond.py checks every demo,
    test_exercises.py the notebook 07 exercises. (The finished torchrun, what its demos observed, the exit report
    of tests/gloo_exit_hook.py: the gloo threads each rank still had as it exited.)"""
    from gloo_exit_hook import exit_env, exit_report_in
    from helpers import BEYOND_DEMO_GROUPS, MICRO_BATCHES, aborted_at_exit, assert_ok, read_json, run_torchrun

    def made(group):
        def run(folder):
            folder.mkdir()
            env, _ = exit_env(folder)
            done = run_torchrun("demos/beyond_ddp.py", "--demo", *BEYOND_DEMO_GROUPS[group], "--micro-batches",
                                MICRO_BATCHES, "--json", folder / "observed.json", env=env)
            saved_run(done, folder / "run.json")
            # A group left alive to the end (the FSDP2 demo's, or a regression's) can abort a rank at exit, by chance:
            # after the record was written, which is all the other tests read. test_beyond.py's
            # test_the_demos_free_their_groups fails then; any other failure fails here.
            if not aborted_at_exit(done):
                assert_ok(done)

        folder = made_once(f"beyond-demos-{group}", run)
        return read_run(folder / "run.json"), read_json(folder / "observed.json"), exit_report_in(folder)

    return made


@pytest.fixture(scope="session")
def ddp_mechanics_run():
    """One run of every demo of scripts/demos/ddp_mechanics.py, once for the session (made_once): test_ddp_demos.py
    checks each demo, test_exercises.py a notebook 04 exercise. (What it printed, what its demos observed, the
    checkpoint it saved the wrong way (--save-prefixed), the exit report of tests/gloo_exit_hook.py.)"""
    from gloo_exit_hook import exit_env, exit_report_in
    from helpers import assert_ok, read_json, run_torchrun

    def run(folder):
        folder.mkdir()
        env, _ = exit_env(folder)
        done = run_torchrun("demos/ddp_mechanics.py", "--device", "cpu", "--json", folder / "demos.json",
                            "--save-prefixed", folder / "prefixed.pt", env=env)
        saved_run(done, folder / "run.json")
        assert_ok(done)

    folder = made_once("ddp-mechanics-run", run)
    return (read_run(folder / "run.json").stdout, read_json(folder / "demos.json"), folder / "prefixed.pt",
            exit_report_in(folder))
