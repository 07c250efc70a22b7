"""Faults a real job meets, each in real processes: a full disk while checkpointing, a loss that blows up, the
same run started twice on one checkpoint folder (and a killed run's follow-up), and a resumed run's figures.

The `timeout=` of each subprocess is a hang guard, not a speed target.
"""
import contextlib
import os
import shutil
import signal
import socket
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
    """A 48 MiB file system of its own (tmpfs): room for the 3 checkpoints (13.8 MiB each) of the run below."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root (CI runs as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_stops_every_rank_with_one_line_and_leaves_nothing_behind(small_disk):
    """The drill fills the file system just before step 4's checkpoint, as another job's output would: every rank
    stops after step 4 with the same line, nothing of the write is left, and step 2's checkpoint is the one to
    resume from. Then a run whose checkpoints cannot fit stops before training."""
    folder = small_disk / "run"
    done = run_torchrun("step4_ddp.py", *SHORT, "--checkpoint-every", 2, *outputs(folder),
                        "--fault", "disk-full", "--fault-step", 3, timeout=180)
    assert "fault drill: rank 0 fills the file system of " in done.stdout
    assert_one_line_error(done, "could not write checkpoint checkpoint-00000004.pt into ",
                          "(No space left on device): it needs about 13.7 MiB and 0.0 MiB is free there",
                          "Nothing of it was left; the newest, checkpoint-00000002.pt, is the one to resume from")
    assert len(set(error_lines(done))) == 1 and len(error_lines(done)) == 2, done.stderr  # every rank, one line
    assert "epoch 1/1" not in done.stdout  # it stopped at the step it could not save
    # No partial file, no lock, the drill's filler gone with its process, and the line noted for a restarted group.
    assert sorted(path.name for path in folder.iterdir()) == ["FAILED", "checkpoint-00000002.pt"]
    assert (folder / "FAILED").read_text().strip() in error_lines(done)[0]
    assert checkpoints.read(folder / "checkpoint-00000002.pt", "cpu")["global_step"] == 2

    fresh = run_python("step1_baseline.py", *SHORT, "--checkpoint-every", 2, *outputs(small_disk / "another"),
                       timeout=120)  # 34 MiB free; 3 checkpoints of 13.7 MiB
    assert_one_line_error(fresh, "--checkpoint-dir ", " free, and this run needs about 41.2 MiB more there: 3 "
                          "checkpoint(s) of 13.7 MiB at once (every one it writes): put --checkpoint-dir on a file "
                          "system with room (a scratch folder), or free space there")
    assert "epoch 1/1" not in fresh.stdout and not (small_disk / "another" / folder_lock.NAME).exists()


# ---------------------------------------------------------------- a loss that blows up

DIVERGING = ("--optimizer", "sgd", "--lr", "1e4")  # the loss is NaN at step 4 on both ranks


@pytest.mark.slow
def test_a_loss_that_is_no_longer_finite_stops_every_rank_and_no_checkpoint_of_it_is_written(tmp_path):
    """Without a checkpoint due, the ranks' step agreement carries it: every rank stops after step 5 with the same
    line, exit status 1, and the checkpoint of step 3 stays the newest, unfinished. The group torchrun restarts
    (--max-restarts) would meet it again from there: it stops before training, saying so."""
    folder = tmp_path / "run"
    done = run_torchrun("step4_ddp.py", *SHORT, *DIVERGING, "--checkpoint-every", 3, *outputs(folder), timeout=180,
                        launcher=("--max-restarts=1",))
    line = ("the training loss became nan on rank 0, nan on rank 1 at step 4: training stopped, and the newest "
            "checkpoint, ")
    assert_one_line_error(done, line, "checkpoint-00000003.pt, is from before it",
                          "a learning rate too high for the global batch of 64")
    first, restarted = error_lines(done)[:2], error_lines(done)[2:]
    assert len(set(first)) == 1 and len(first) == 2, done.stderr
    assert len(set(restarted)) == 1 and len(restarted) == 2, done.stderr
    assert restarted[0].startswith("error: rank 0 (") and line in restarted[0], restarted[0]
    assert restarted[0].endswith("[this group, restarted by torchrun, would meet it again and stops: fix the cause, "
                                 "then start the job again]")
    assert done.stdout.count("pre-flight all_reduce ok") == 2 and "resumed from" not in done.stdout
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
        deadline = time.monotonic() + 180  # a hang guard: the holder writes it within seconds
        while not (folder / "checkpoint-00000002.pt").exists() and time.monotonic() < deadline:
            assert first_to_end([holder], seconds=0.2) is None, "the run that holds the folder ended early"
        assert (folder / "checkpoint-00000002.pt").exists()
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
    if process.poll() is not None:
        return
    workers = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
    assert workers, "torchrun has no workers to kill"
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


def test_a_lock_of_another_machine_is_stale_after_its_heartbeat_stops_or_when_it_is_an_earlier_run_of_this_job(
        tmp_path, monkeypatch):
    """What one host cannot see by itself: a lock of another machine (outside any scheduler's job here, so no
    scheduler is asked) is held while its time is fresh and taken over once it is older than STALE_AFTER. One that
    names this scheduler job is taken over at once if it is from an earlier run of the job (a requeue, a restart),
    and held if it is from this one (a second run in the same allocation). The scheduler's answer for another job:
    tests/test_pbs.py, tests/test_slurm.py."""
    path = tmp_path / folder_lock.NAME
    other = {"host": "another-node", "machine": ["boot", "pid:[1]"], "pid": 1, "started": None, "job": None,
             "incarnation": [None, None, None], "token": "x", "since": 0}
    assert folder_lock.create(path, other)
    with pytest.raises(folder_lock.CourseError, match=r"is in use by another run \(pid 1 on another-node, since "):
        folder_lock.take(tmp_path)
    old = path.stat().st_mtime - folder_lock.STALE_AFTER - 1
    os.utime(path, (old, old))
    lock = folder_lock.take(tmp_path)
    assert folder_lock.read(path) == lock.holder and not list(tmp_path.glob(".LOCK*"))
    path.unlink()  # gone for a moment (a file server's hiccup, another run setting it aside): not a takeover
    lock.check()
    assert folder_lock.create(path, {**other, "token": "y"})  # another run's, made after a takeover
    with pytest.raises(folder_lock.CourseError, match=r"another run \(pid 1 on another-node\) took over "):
        lock.check()
    lock.release()
    assert folder_lock.read(path)["token"] == "y"  # a lock no longer this run's is not removed
    path.unlink()

    for name in ("PBS_JOBID", "COURSE_JOB_START", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    this_job = {**other, "job": "Slurm 7", "incarnation": [None, "1", None]}
    assert folder_lock.why_stale(this_job, 0) is None  # this very run of the job: another run in its allocation
    requeued = {**this_job, "incarnation": [None, "0", None]}
    assert folder_lock.why_stale(requeued, 0) == "it is this job's (Slurm 7) from before a restart or requeue"
    assert folder_lock.why_stale({**this_job, "host": socket.gethostname()}, 0) is None  # same name, other machine
