"""Checkpoints resume exactly: a run that is killed, stopped or crashes while saving, and
then continues, ends with the same weights, bit for bit, as a run that was never
interrupted. Dropout is ON in every run here: each rank's random stream must be restored
too, not only the weights and the optimizer.

The runs: 2 epochs of 6 steps (batch 32), a checkpoint every 4 steps and at each epoch
end, so checkpoints land at steps 4, 6 (end of epoch 1), 8 and 12 (end of epoch 2).
The single-process reference keeps the newest 2 of them (--keep-checkpoints 2). Each epoch ends scoring the
short test split (tests/helpers.py): the claims are about the weights.
"""
import os
import signal
import subprocess

import pytest
import torch

from helpers import (
    REPO,
    RESUMABLE_RUN,
    assert_ok,
    assert_same_weights,
    read_json,
    run_outputs,
    run_python,
    run_torchrun,
    saved_weights,
    script_env,
    torchrun_command,
)
from kit import checkpoints
from lesson import models

pytestmark = pytest.mark.slow  # every test here compares runs that are killed, stopped or resumed

RUN = RESUMABLE_RUN
# The reference runs, `uninterrupted`, are shared with test_graceful_stop.py (tests/conftest.py).


def test_the_reference_runs_really_differ_from_their_start(uninterrupted):
    """Guard for every test below: equal weights must mean equal training, not no training."""
    torch.manual_seed(0)
    untrained = models.Net().state_dict()
    assert not torch.equal(untrained["fc1.weight"], uninterrupted["ddp"]["fc1.weight"])
    assert not torch.equal(uninterrupted["ddp"]["fc1.weight"], uninterrupted["single"]["fc1.weight"])


def test_a_killed_worker_is_restarted_by_torchrun_and_the_run_ends_with_the_same_weights(uninterrupted, tmp_path):
    done = run_torchrun("step4_ddp.py", *RUN, *run_outputs(tmp_path, "killed"),
                        "--fault", "kill", "--fault-rank", 1, "--fault-step", 10, launcher=("--max-restarts=1",))
    assert_ok(done)
    assert "fault drill: rank 1 kills itself (SIGKILL) after step 10" in done.stdout
    # The restarted group resumed mid-epoch from the step-8 checkpoint and re-trained steps 9 and 10.
    assert "checkpoint-00000008.pt: epoch 2, 2 of" in done.stdout, done.stdout
    assert_same_weights(saved_weights(tmp_path, "killed"), uninterrupted["ddp"])
    # Its record covers both epochs, with the same losses as the uninterrupted run.
    record = read_json(tmp_path / "results" / "killed.json")
    assert [e["epoch"] for e in record["per_epoch"]] == [1, 2]
    for resumed, reference in zip(record["per_epoch"], uninterrupted["ddp_record"]["per_epoch"]):
        assert resumed["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-12)
        assert resumed["test_accuracy"] == reference["test_accuracy"]


def test_a_run_stopped_by_hand_continues_with_the_same_command(uninterrupted, tmp_path):
    """Ctrl-C (SIGINT to torchrun's process group) while rank 0 stalls after step 8's
    checkpoint; then the very same command line, which carries --resume from the start."""
    command = torchrun_command("step4_ddp.py", *RUN, *run_outputs(tmp_path, "by-hand"), "--resume",
                               "--fault", "stall", "--fault-rank", 0, "--fault-step", 8, "--fault-seconds", 600)
    first = subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    seen = []
    for line in first.stdout:
        seen.append(line)
        if "fault drill: rank 0 stalls" in line:
            os.killpg(first.pid, signal.SIGINT)
            break
    first.communicate(timeout=120)
    assert first.returncode != 0, "".join(seen)
    assert "no checkpoint in" in "".join(seen)  # the first start found nothing to resume
    second = subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300)
    assert_ok(second)
    assert "checkpoint-00000008.pt: epoch 2, 2 of" in second.stdout
    assert "fault drill" not in second.stdout  # resumed after step 8: the drill's step is behind it
    assert_same_weights(saved_weights(tmp_path, "by-hand"), uninterrupted["ddp"])


def test_a_crash_halfway_through_writing_a_checkpoint_leaves_the_one_before_loadable(uninterrupted, tmp_path):
    """Single process: rank 0 dies (SIGKILL) with half of step 6's checkpoint written."""
    crashed = run_python("step1_baseline.py", *RUN, *run_outputs(tmp_path, "crash"),
                         "--fault", "crash-in-save", "--fault-step", 5)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    folder = tmp_path / "crash-checkpoints"
    assert [p.name for p in checkpoints.checkpoints_in(folder)] == ["checkpoint-00000004.pt"]
    partial = list(folder.glob(".checkpoint-00000006.pt.partial-*"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0  # the write really was cut off midway
    state = checkpoints.read(folder / "checkpoint-00000004.pt", torch.device("cpu"))
    assert (state["epoch"], state["batches_done"], state["global_step"]) == (1, 4, 4)

    resumed = run_python("step1_baseline.py", *RUN, *run_outputs(tmp_path, "crash"), "--resume")
    assert_ok(resumed)
    assert "checkpoint-00000004.pt: epoch 1, 4 of" in resumed.stdout
    assert not list(folder.glob(".checkpoint-*.partial-*"))  # the torn file is cleaned up
    assert_same_weights(saved_weights(tmp_path, "crash"), uninterrupted["single"])


def test_the_dataloader_route_with_a_worker_resumes_exactly(tmp_path):
    loader = ("--loader", "dataloader", "--workers", 1)
    assert_ok(run_python("step1_baseline.py", *RUN, *loader, *run_outputs(tmp_path, "whole")))
    stopped = run_python("step1_baseline.py", *RUN, *loader, *run_outputs(tmp_path, "stopped"),
                         "--fault", "exit", "--fault-step", 8)
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    assert_ok(run_python("step1_baseline.py", *RUN, *loader, *run_outputs(tmp_path, "stopped"), "--resume"))
    assert_same_weights(saved_weights(tmp_path, "stopped"), saved_weights(tmp_path, "whole"))


def test_a_checkpoint_holds_the_plain_model_and_loads_with_weights_only(uninterrupted):
    """The newest checkpoint of the uninterrupted 2-process DDP run: its end."""
    newest = checkpoints.checkpoints_in(uninterrupted["folder"] / "ddp-checkpoints")[-1]
    state = torch.load(newest, map_location="cpu", weights_only=True)
    assert not any(key.startswith("module.") for key in state["model"])
    models.Net().load_state_dict(state["model"])  # strict: every key matches
    assert len(state["ranks"]) == 2 and state["finished"] is True
    assert not torch.equal(state["ranks"][0]["rng"]["cpu"], state["ranks"][1]["rng"]["cpu"])  # per-rank streams


def test_only_the_newest_checkpoints_are_kept(uninterrupted):
    """The single-process reference wrote checkpoints 4, 6, 8 and 12 with --keep-checkpoints 2."""
    names = [p.name for p in checkpoints.checkpoints_in(uninterrupted["folder"] / "single-checkpoints")]
    assert names == ["checkpoint-00000008.pt", "checkpoint-00000012.pt"]


# step1_baseline.py and step4_ddp.py: their final weights are the uninterrupted runs' (--save in run_outputs).
SAVED_BY_THE_REFERENCE_RUNS = {"step1_baseline.py": "single", "step4_ddp.py": "ddp"}


@pytest.mark.parametrize("script", ["step1_baseline.py", "step3_data_parallel.py", "step2_allreduce.py",
                                    "step4_ddp.py"])
def test_every_training_script_saves_final_weights_that_load_into_a_plain_model(script, uninterrupted, tmp_path):
    """What --save writes does not depend on the world size (rank 0 writes the plain model): step2_allreduce.py
    runs as a world of one here, with python."""
    if script in SAVED_BY_THE_REFERENCE_RUNS:
        path = uninterrupted["folder"] / f"{SAVED_BY_THE_REFERENCE_RUNS[script]}.pt"
    else:
        assert_ok(run_python(script, "--epochs", 1, "--max-steps", 2, *run_outputs(tmp_path, "final")))
        path = tmp_path / "final.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert not any(key.startswith("module.") for key in state)
    models.Net().load_state_dict(state)  # strict: every key matches
