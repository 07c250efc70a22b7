"""Every entry script runs end to end, as a user starts it, and writes a valid JSON record."""
import pytest
import torch

from conftest import assert_ok, read_json, run_python, run_torchrun
from core import models

SHORT = ("--epochs", 2, "--max-steps", 4, "--batch-size", 32)
RECORD_KEYS = {"script", "world_size", "backend", "device", "hardware", "dataset", "model", "batch_size",
               "global_batch_size", "epochs", "per_epoch", "total_seconds", "final_test_accuracy", "final_test_loss"}
EPOCH_KEYS = {"epoch", "train_loss", "test_loss", "test_accuracy", "seconds", "samples_per_second", "mfu"}

CASES = {
    "train_single": (run_python, "train_single.py", (), 1, None),
    "train_dp": (run_python, "train_dp.py", (), 1, None),
    "train_allreduce per-parameter": (run_torchrun, "train_allreduce.py", ("--mode", "per-parameter"), 2, "gloo"),
    "train_allreduce bucket": (run_torchrun, "train_allreduce.py", ("--mode", "bucket"), 2, "gloo"),
    "train_ddp": (run_torchrun, "train_ddp.py", (), 2, "gloo"),
}


@pytest.mark.parametrize("case", CASES)
def test_script_runs_and_writes_its_record(case, results_dir):
    launch, script, extra, world_size, backend = CASES[case]
    done = launch(script, *SHORT, *extra, "--results-dir", results_dir, "--run-name", "run")
    assert_ok(done)
    record = read_json(results_dir / "run.json")
    assert RECORD_KEYS <= record.keys()
    assert record["script"] == script.removesuffix(".py")
    assert (record["world_size"], record["backend"], record["device"]) == (world_size, backend, "cpu")
    assert record["global_batch_size"] == 32 * world_size
    assert [e["epoch"] for e in record["per_epoch"]] == [1, 2]
    for epoch in record["per_epoch"]:
        assert EPOCH_KEYS <= epoch.keys()
        assert epoch["test_samples"] == 1000 and 0.0 <= epoch["test_accuracy"] <= 1.0
        assert epoch["seconds"] > 0 and epoch["samples_per_second"] > 0
        assert epoch["mfu"] is None  # no known peak for a CPU
    # Rank 0 alone prints the epoch lines: one per epoch, not one per rank.
    assert done.stdout.count("epoch 1/2") == 1
    if world_size > 1:
        assert "pre-flight all_reduce ok: 2 rank(s) on 1 node(s)" in done.stdout


def test_ddp_saves_unwrapped_weights_that_load_into_a_plain_model(tmp_path, results_dir):
    checkpoint = tmp_path / "ddp.pt"
    assert_ok(run_torchrun("train_ddp.py", *SHORT, "--results-dir", results_dir, "--save", checkpoint))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert not any(key.startswith("module.") for key in state)
    models.Net().load_state_dict(state)  # strict: every key matches


def test_allreduce_and_ddp_train_identically(results_dir):
    """Same seed, same shards, dropout on but seeded per rank alike: the same numbers."""
    for script, name in (("train_allreduce.py", "allreduce"), ("train_ddp.py", "ddp")):
        assert_ok(run_torchrun(script, *SHORT, "--results-dir", results_dir, "--run-name", name))
    allreduce, ddp = read_json(results_dir / "allreduce.json"), read_json(results_dir / "ddp.json")
    for a, d in zip(allreduce["per_epoch"], ddp["per_epoch"]):
        assert a["train_loss"] == pytest.approx(d["train_loss"], abs=1e-5)
        assert a["test_accuracy"] == pytest.approx(d["test_accuracy"], abs=2e-3)


def test_dataloader_route_runs_with_workers(results_dir):
    done = run_python("train_single.py", *SHORT, "--loader", "dataloader", "--workers", 1,
                      "--results-dir", results_dir, "--run-name", "run")
    assert_ok(done)
    assert read_json(results_dir / "run.json")["loader"] == "dataloader"


@pytest.mark.slow
def test_ddp_reaches_94_percent_within_three_epochs(results_dir):
    done = run_torchrun("train_ddp.py", "--epochs", 3, "--seed", 0, "--results-dir", results_dir, "--run-name", "run")
    assert_ok(done)
    record = read_json(results_dir / "run.json")
    assert record["world_size"] == 2 and record["epochs"] == 3
    assert record["final_test_accuracy"] >= 0.94, done.stdout
