"""scripts/demos/collectives.py under torchrun: every rank ends with what the collective promises,
and the printed report is in rank order on every run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_demo(tmp_path, nproc):
    record = tmp_path / "collectives.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(REPO / "scripts" / "demos/collectives.py"), "--device", "cpu", "--backend", "gloo",
               "--json", str(record)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(record.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("demo"), nproc=2)


def test_every_rank_reports_who_it_is(two_ranks):
    _, record = two_ranks
    assert record["world_size"] == 2
    assert [r["local_rank"] for r in record["ranks"]] == [0, 1]
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in record["ranks"])


def test_all_reduce_leaves_the_sum_on_every_rank(two_ranks):
    _, record = two_ranks
    assert record["all_reduce"]["before"] == [[1, 10, 100], [2, 20, 200]]
    assert record["all_reduce"]["after"] == [[3, 30, 300], [3, 30, 300]]
    assert record["all_reduce_mean"]["after"] == [[1.5, 15, 150], [1.5, 15, 150]]


def test_broadcast_leaves_rank_0s_tensor_on_every_rank(two_ranks):
    _, record = two_ranks
    before, after = record["broadcast"]["before"], record["broadcast"]["after"]
    assert before[0] != before[1]  # the ranks really did start apart
    assert after == [before[0], before[0]]


def test_all_gather_leaves_every_tensor_on_every_rank(two_ranks):
    _, record = two_ranks
    assert record["all_gather"]["before"] == [[0, 1], [10, 11]]
    assert record["all_gather"]["after"] == [[[0, 1], [10, 11]]] * 2


def test_only_rank_0_prints_in_rank_order(two_ranks):
    stdout, _ = two_ranks
    assert stdout.count("who is who") == 1
    assert "  rank 0  before [1, 10, 100]  after [3, 30, 300]\n  rank 1  before [2, 20, 200]  after [3, 30, 300]" in stdout
    assert "  rank 1  before [10, 11]  after [[0, 1], [10, 11]]" in stdout


@pytest.mark.slow
def test_time_averaging_times_both_functions_on_both_models(tmp_path):
    record = tmp_path / "timings.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "scripts" / "demos/collectives.py"), "--device", "cpu", "--backend", "gloo",
               "--time-averaging", "--repeats", "2", "--json", str(record)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    timings = json.loads(record.read_text())["timings_ms"]
    assert timings["Net"]["tensors"] == 8 and timings["Net"]["floats"] == 1_199_882
    assert timings["160 tensors"]["tensors"] == 160
    for row in timings.values():
        assert row["per-parameter"] > 0 and row["bucket"] > 0
    assert "milliseconds per call" in done.stdout
