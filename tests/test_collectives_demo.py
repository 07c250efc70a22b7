"""scripts/demos/collectives.py under torchrun: every rank ends with what the collective promises,
and the printed report is in rank order on every run.

The script once aborted at exit, its gloo group left alive: every run here also counts, with
the exit hook of tests/gloo_exit_hook.py, the gloo threads each rank still has when it exits, for each of the
script's three ways to end.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gloo_exit_hook import COUNTS_THREADS_IN_PROC, exit_env, gloo_threads_at_exit

REPO = Path(__file__).resolve().parents[1]


def run_demo(tmp_path, *mode):
    """The demo in 2 processes, its report on stdout, what rank 0 wrote to --json, and the exit hook's counts."""
    record = tmp_path / "collectives.json"
    env, exit_report = exit_env(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "scripts" / "demos/collectives.py"), "--device", "cpu", "--backend", "gloo",
               *map(str, mode), "--json", str(record)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(record.read_text()), exit_report


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("demo"))


def test_every_rank_reports_who_it_is(two_ranks):
    _, record, _ = two_ranks
    assert record["world_size"] == 2
    assert [r["local_rank"] for r in record["ranks"]] == [0, 1]
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in record["ranks"])


def test_all_reduce_leaves_the_sum_on_every_rank(two_ranks):
    _, record, _ = two_ranks
    assert record["all_reduce"]["before"] == [[1, 10, 100], [2, 20, 200]]
    assert record["all_reduce"]["after"] == [[3, 30, 300], [3, 30, 300]]
    assert record["all_reduce_mean"]["after"] == [[1.5, 15, 150], [1.5, 15, 150]]


def test_broadcast_leaves_rank_0s_tensor_on_every_rank(two_ranks):
    _, record, _ = two_ranks
    before, after = record["broadcast"]["before"], record["broadcast"]["after"]
    assert before[0] != before[1]  # the ranks really did start apart
    assert after == [before[0], before[0]]


def test_all_gather_leaves_every_tensor_on_every_rank(two_ranks):
    _, record, _ = two_ranks
    assert record["all_gather"]["before"] == [[0, 1], [10, 11]]
    assert record["all_gather"]["after"] == [[[0, 1], [10, 11]]] * 2


def test_only_rank_0_prints_in_rank_order(two_ranks):
    stdout, _, _ = two_ranks
    assert stdout.count("who is who") == 1
    assert ("  rank 0  before [1, 10, 100]  after [3, 30, 300]\n"
            "  rank 1  before [2, 20, 200]  after [3, 30, 300]") in stdout
    assert "  rank 1  before [10, 11]  after [[0, 1], [10, 11]]" in stdout


@COUNTS_THREADS_IN_PROC
def test_the_demo_frees_its_group(two_ranks):
    _, _, exit_report = two_ranks
    assert gloo_threads_at_exit(exit_report) == [(0, 0), (1, 0)]


@pytest.fixture(scope="module")
def time_averaging(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("timings"), "--time-averaging", "--repeats", 2)


@pytest.mark.slow
def test_time_averaging_times_both_functions_on_both_models(time_averaging):
    stdout, record, _ = time_averaging
    timings = record["timings_ms"]
    assert timings["Net"]["tensors"] == 8 and timings["Net"]["floats"] == 1_199_882
    assert timings["160 tensors"]["tensors"] == 160
    for row in timings.values():
        assert row["per-parameter"] > 0 and row["bucket"] > 0
    assert "milliseconds per call" in stdout


@pytest.mark.slow
@COUNTS_THREADS_IN_PROC
def test_time_averaging_frees_its_group(time_averaging):
    _, _, exit_report = time_averaging
    assert gloo_threads_at_exit(exit_report) == [(0, 0), (1, 0)]


@pytest.mark.slow
@COUNTS_THREADS_IN_PROC
def test_a_late_rank_run_frees_its_group(tmp_path):
    _, record, exit_report = run_demo(tmp_path, "--late-rank", 0.2)
    assert record["world_size"] == 2
    assert gloo_threads_at_exit(exit_report) == [(0, 0), (1, 0)]
