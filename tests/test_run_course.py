"""`make run`: the whole course path runs and ends with one comparison table."""
import pytest

from helpers import assert_ok, run_python

# Every step of the course in turn: make test runs it, make test-fast leaves it out.
pytestmark = pytest.mark.slow

STEPS = ["1 one process", "2 all_reduce per-parameter", "2 all_reduce bucket", "3 DataParallel", "4 DDP"]


def test_run_course_prints_a_row_per_step(tmp_path):
    done = run_python("tools/run_course.py", "--epochs", 1, "--results-dir", tmp_path, "--", "--max-steps", 3, timeout=600)
    assert_ok(done)
    table = done.stdout.split("\nstep ")[-1].splitlines()
    rows = table[2:]  # after the header and its rule
    assert [row[:28].strip() for row in rows] == STEPS
    processes = [int(row.split()[-7]) for row in rows]
    assert processes == [1, 2, 2, 1, 2]  # no GPU here: 2 processes for the distributed steps
    assert all(row.endswith("%") for row in rows)
    assert sorted(path.name for path in tmp_path.glob("*.json")) == [
        "step1-step1_baseline.json", "step2-step2_allreduce.json", "step3-step2_allreduce.json",
        "step4-step3_data_parallel.json", "step5-step4_ddp.json"]
