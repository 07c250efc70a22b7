"""Faults a real job meets, each in real processes: a full disk while checkpointing, a loss that blows up, the
same run started twice on one checkpoint folder (and a killed run's follow-up), and a resumed run's figures.

The `timeout=` of each subprocess is a hang guard, not a speed target.
"""
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (
    REPO,
    assert_ok,
    assert_one_line_error,
    error_lines,
    read_json,
    run_python,
    run_torchrun,
    script_env,
    torchrun_command,
)
from kit import checkpoints
from machinery import folder_lock

SHORT = ("--epochs", 1, "--max-steps", 6, "--batch-size", 32)


def outputs(folder):
    return ("--checkpoint-dir", folder, "--results-dir", folder.parent / "results")


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB file system of its own (tmpfs): one checkpoint of the Net with Adam (13.7 MiB) fits, two do not."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root (CI runs as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_stops_every_rank_with_one_line_and_leaves_nothing_behind(small_disk):
    """Step 2's checkpoint fits, step 4's does not: every rank stops after step 4 with the same line, the partial
    file is gone, and step 2's checkpoint is the one to resume from. A run that starts on the full disk stops
    before training."""
    folder = small_disk / "run"
    done = run_torchrun("step4_ddp.py", *SHORT, "--checkpoint-every", 2, *outputs(folder), timeout=180)
    assert_one_line_error(done, "could not write checkpoint checkpoint-00000004.pt into ",
                          "(No space left on device): it needs 13.", "--keep-checkpoints, now 3",
                          "Nothing of it was left; the newest, checkpoint-00000002.pt, is the one to resume from")
    assert len(set(error_lines(done))) == 1 and len(error_lines(done)) == 2, done.stderr  # every rank, one line
    assert "epoch 1/1" not in done.stdout  # it stopped at the step it could not save
    assert sorted(path.name for path in folder.iterdir()) == ["checkpoint-00000002.pt"]  # no partial, no lock
    assert checkpoints.read(folder / "checkpoint-00000002.pt", "cpu")["global_step"] == 2

    fresh = run_python("step1_baseline.py", *SHORT, *outputs(small_disk / "another"), timeout=120)
    assert_one_line_error(fresh, "--checkpoint-dir ", " free, and a checkpoint of this run needs at least 13.7 MiB")
    assert "epoch 1/1" not in fresh.stdout and not checkpoints.checkpoints_in(small_disk / "another")


# ---------------------------------------------------------------- a loss that blows up

DIVERGING = ("--optimizer", "sgd", "--lr", "1e4")  # the loss is NaN at step 4 on both ranks


@pytest.mark.slow
def test_a_loss_that_is_no_longer_finite_stops_every_rank_and_no_checkpoint_of_it_is_written(tmp_path):
    """Without a checkpoint due, the ranks' step agreement carries it: every rank stops after step 5 with the same
    line, exit status 1, and the checkpoint of step 3 stays the newest, unfinished."""
    folder = tmp_path / "run"
    done = run_torchrun("step4_ddp.py", *SHORT, *DIVERGING, "--checkpoint-every", 3, *outputs(folder), timeout=180)
    assert_one_line_error(done, "the training loss became nan on rank 0, nan on rank 1 at step 4: training stopped, "
                                "and the newest checkpoint, ", "checkpoint-00000003.pt, is from before it",
                          "a learning rate too high for the global batch of 64")
    assert len(set(error_lines(done))) == 1 and len(error_lines(done)) == 2, done.stderr
    assert "exitcode  : 1" in done.stderr
    assert [path.name for path in checkpoints.checkpoints_in(folder)] == ["checkpoint-00000003.pt"]
    assert checkpoints.read(folder / "checkpoint-00000003.pt", "cpu")["finished"] is False


@pytest.mark.slow
def test_train_through_nan_trains_on_and_writes_no_checkpoint_of_it(tmp_path):
    """A world of one: the run ends, and each checkpoint due after the divergence is left out with a line."""
    folder = tmp_path / "run"
    done = run_python("step4_ddp.py", *SHORT, *DIVERGING, "--checkpoint-every", 2, "--train-through-nan",
                      *outputs(folder), timeout=120)
    assert_ok(done)
    assert "checkpoint of step 4 not written: the training loss is not finite (nan on rank 0) " \
           "(--train-through-nan)" in done.stdout
    assert "epoch 1/1  train loss nan" in done.stdout
    assert [path.name for path in checkpoints.checkpoints_in(folder)] == ["checkpoint-00000002.pt"]


# ---------------------------------------------------------------- one run per checkpoint folder

STALLING = ("--epochs", 1, "--max-steps", 6, "--batch-size", 32, "--checkpoint-every", 2, "--fault", "stall",
            "--fault-rank", 1, "--fault-step", 2, "--fault-seconds", 600)


def start(command):
    return subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.mark.slow
def test_two_runs_on_one_folder_one_refuses_and_a_killed_runs_follow_up_takes_it_over(tmp_path):
    """Two torchruns started together on one folder, both stalling after step 2's checkpoint: the one that took
    the folder trains, the other stops before training, naming it. The holder is then killed (SIGKILL to torchrun
    and its workers, as a lost node leaves it: its lock behind); its follow-up with --resume takes the folder over
    and finishes, and its figures count only what it trained."""
    folder = tmp_path / "run"
    runs = [start(torchrun_command("step4_ddp.py", *STALLING, *outputs(folder), "--run-name", f"run{number}"))
            for number in (1, 2)]
    try:
        refused = first_to_end(runs, seconds=180)  # the holder stalls for 600 s: only the other can end
        assert refused is not None, "neither run stopped: both are training in one folder"
        holder = next(run for run in runs if run is not refused)
        stdout, stderr = refused.communicate(timeout=60)
        assert_one_line_error(subprocess.CompletedProcess(refused.args, refused.returncode, stdout, stderr),
                              "is in use by another run (pid ", "wait for it to end, or give this run another "
                              "--checkpoint-dir")
        assert "epoch 1/1" not in stdout and "checkpoint " not in stdout  # it trained and wrote nothing
        while not (folder / "checkpoint-00000002.pt").exists() and first_to_end([holder], seconds=0.2) is None:
            pass
        assert holder.poll() is None, "the run that holds the folder ended early"
    finally:
        for run in runs:
            kill_with_workers(run)
    owner = folder_lock.read(folder / folder_lock.NAME)
    assert owner is not None, "the killed run left no lock: this test would not show a takeover"

    follow_up = run_torchrun("step4_ddp.py", *STALLING[:8], *outputs(folder), "--resume", "--run-name", "follow-up",
                             timeout=180)
    assert_ok(follow_up)
    assert f"LOCK from pid {owner['pid']} on {owner['host']}: its process {owner['pid']} has ended" in follow_up.stdout
    assert "epoch 1, 2 of 6 batches done, step 2" in follow_up.stdout  # of the epoch's 6 (--max-steps), not 63
    assert not (folder / folder_lock.NAME).exists()  # given back at the end
    epoch, = read_json(tmp_path / "results" / "follow-up.json")["per_epoch"]
    # 4 steps of 2 x 32 trained since the resume, in the seconds since the resume (6 steps' samples in its loss).
    assert epoch["samples_per_second"] * epoch["seconds"] == pytest.approx(4 * 64)


def first_to_end(processes, seconds):
    """The first of ``processes`` to end within ``seconds``, or None."""
    deadline = time.monotonic() + seconds
    while True:
        ended = next((process for process in processes if process.poll() is not None), None)
        if ended is not None or time.monotonic() > deadline:
            return ended
        time.sleep(0.1)


def kill_with_workers(process):
    """SIGKILL to torchrun and its workers (each in a session of its own), then reap torchrun."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    workers = [int(pid) for pid in children.read_text().split()] if children.exists() else []
    for pid in [process.pid, *workers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=60)
    while not all(map(ended, workers)):
        time.sleep(0.05)


def ended(pid):
    try:
        return "(zombie)" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def test_a_lock_of_another_node_is_stale_after_its_heartbeat_stops_or_when_it_is_this_jobs(tmp_path, monkeypatch):
    """What cannot be seen from one host: a lock of another node (outside any scheduler's job here, so no scheduler
    is asked) is held while its time is fresh and taken over once it is older than STALE_AFTER; one that names this
    very scheduler job (a requeue) is taken over at once. The scheduler's answer: tests/test_pbs.py, test_slurm.py."""
    path = tmp_path / folder_lock.NAME
    other = {"host": "another-node", "pid": 1, "started": None, "job": None, "token": "x", "since": 0}
    assert folder_lock.create(path, other)
    with pytest.raises(folder_lock.CourseError, match=r"is in use by another run \(pid 1 on another-node, since "):
        folder_lock.take(tmp_path)
    old = path.stat().st_mtime - folder_lock.STALE_AFTER - 1
    os.utime(path, (old, old))
    assert folder_lock.why_stale(other, folder_lock.STALE_AFTER + 1) == "no sign of life from another-node for 121 s"
    lock = folder_lock.take(tmp_path)
    assert folder_lock.read(path) == lock.holder
    lock.release()
    assert not path.exists()
    monkeypatch.delenv("PBS_JOBID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert folder_lock.why_stale({**other, "job": "Slurm 7"}, 0) == ("it is this job's (Slurm 7), from before a "
                                                                      "restart or requeue")
