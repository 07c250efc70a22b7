"""Fixtures only; what the tests share besides is in helpers.py."""
import contextlib
import fcntl
import os
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


@pytest.fixture(scope="session")
def uninterrupted():
    """The reference runs of helpers.RESUMABLE_RUN, never interrupted: DDP in 2 processes, and the single-process
    baseline, which also shows the pruning of old checkpoints (--keep-checkpoints 2, a setting that changes no
    weight). test_checkpoints.py and test_graceful_stop.py compare their killed, stopped and resumed runs with
    them. The two files may run in different workers at once: the first to get here trains the runs in the
    session's output folder, which every worker shares, while the others wait for the lock and then read them.
    If the runs failed, the others fail at once instead of training again into the half-written folder."""
    from helpers import RESUMABLE_RUN, assert_ok, read_json, run_outputs, run_python, run_torchrun, saved_weights

    shared = Path(os.environ["COURSE_OUTPUT_DIR"])
    folder = shared / "uninterrupted-runs"
    finished, failed = shared / "uninterrupted-runs.finished", shared / "uninterrupted-runs.failed"
    with held(shared / "uninterrupted-runs.lock"):
        if failed.exists():
            pytest.fail("the uninterrupted reference runs failed in another test process: its report shows why")
        if not finished.exists():
            try:
                assert_ok(run_torchrun("step4_ddp.py", *RESUMABLE_RUN, *run_outputs(folder, "ddp")))
                assert_ok(run_python("step1_baseline.py", *RESUMABLE_RUN, "--keep-checkpoints", 2,
                                     *run_outputs(folder, "single")))
            except BaseException:
                failed.touch()
                raise
            finished.touch()
    return {"ddp": saved_weights(folder, "ddp"), "single": saved_weights(folder, "single"),
            "ddp_record": read_json(folder / "results" / "ddp.json"), "folder": folder}
