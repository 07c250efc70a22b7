"""No work lost: a run asked to stop (SIGTERM as a scheduler sends it, Ctrl-C, its time budget, a STOP file)
stops every rank after the same step with a checkpoint of it, and resumed, it ends with the weights of a run
that was never stopped, bit for bit. A worker group that plain torchrun restarts (no
TORCH_DISABLE_SHARE_RDZV_TCP_STORE) resumes too, however often. Bad inputs of the stop get one line before
training.

The signals are sent by drills (machinery/fault_drills.py: ``--fault sigterm|sigint``) from inside the run,
at a chosen step, to torchrun itself, which passes them on to every worker as it does a scheduler's; the drill
waits until the signal has come back. So every run below stops at a known step, whatever the machine's speed.
Dropout is on in every run: each rank's random stream must come back too.
"""
import contextlib
import datetime
import os
import re
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from helpers import (
    PYTHON,
    REPO,
    RESUMABLE_RUN,
    SCRIPTS,
    assert_ok,
    assert_one_line_error,
    assert_same_weights,
    run_outputs,
    run_python,
    run_torchrun,
    saved_weights,
    script_env,
    torchrun_command,
)
from kit import checkpoints, launch_checks
from kit.errors import CourseError
from machinery import cli, graceful_stop, walltime
from notebook_support import rank_stacks

RUN = RESUMABLE_RUN  # 2 epochs of 6 steps (tests/helpers.py); `uninterrupted` runs it (tests/conftest.py)
# After SIGTERM, a process that has not stopped within the grace period ends itself (SIGALRM). A scheduler's
# grace, as the jobs pass it, so that however loaded the machine, the stop below has all the time it needs.
GRACE = ("--grace-period", 60)


def stop_lines(done):
    return [line for line in done.stdout.splitlines() if line.startswith("stopped ")]


def newest_checkpoint(folder):
    return checkpoints.read(checkpoints.checkpoints_in(folder)[-1], torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("fault, name", [("sigterm", "SIGTERM"), ("sigint", "SIGINT")])
def test_a_signal_to_torchrun_stops_every_rank_after_the_same_step_and_the_run_resumes_exactly(
        uninterrupted, tmp_path, fault, name):
    """SIGTERM (a scheduler at the walltime, qdel) or SIGINT (Ctrl-C) reaches torchrun during step 8 of 12;
    torchrun passes it on, the ranks agree to stop after step 9 (the agreement is read one step later), and
    step 9's checkpoint holds both ranks. The same command with --resume then finishes the run."""
    command = (*RUN, *run_outputs(tmp_path, "stopped"), "--resume", "--fault", fault, "--fault-rank", 1,
               "--fault-step", 8, *GRACE)
    stopped = run_torchrun("step4_ddp.py", *command)
    assert stopped.returncode != 0, stopped.stdout  # torchrun itself ends with status 1 after a signal
    assert f"fault drill: rank 1 sends {name} to torchrun after step 8" in stopped.stdout
    folder = tmp_path / "stopped-checkpoints"
    assert stop_lines(stopped) == [
        f"stopped at step 9 ({name}), checkpoint written, resumable: the same command with --resume continues "
        f"from {folder / 'checkpoint-00000009.pt'}"], stopped.stdout + stopped.stderr[-3000:]
    state = newest_checkpoint(folder)
    assert (state["global_step"], state["epoch"], state["batches_done"], len(state["ranks"])) == (9, 2, 3, 2)
    assert graceful_stop.note(folder) == (name, 9)
    assert not (tmp_path / "stopped.pt").exists()  # it did stop: no final weights

    resumed = run_torchrun("step4_ddp.py", *command)
    assert_ok(resumed)
    assert f"resumed from {folder / 'checkpoint-00000009.pt'}: epoch 2, 3 of" in resumed.stdout
    assert "fault drill" not in resumed.stdout and graceful_stop.note(folder) is None
    assert_same_weights(saved_weights(tmp_path, "stopped"), uninterrupted["ddp"])


@pytest.mark.slow
def test_a_signal_to_one_rank_alone_stops_every_rank_after_the_same_step(uninterrupted, tmp_path):
    """SIGTERM to rank 1 alone (as `kill` of one worker sends it): rank 0 learns of it only from the ranks'
    agreement, yet stops after the same step, and writes the checkpoint of it with both ranks' state."""
    command = (*RUN, *run_outputs(tmp_path, "one-rank"), "--resume", "--fault", "sigterm-rank", "--fault-rank", 1,
               "--fault-step", 8, *GRACE)
    stopped = run_torchrun("step4_ddp.py", *command)
    assert "fault drill: rank 1 sends SIGTERM to itself after step 8" in stopped.stdout
    # Rank 0 prints the line: it stopped too, at the step rank 1 stopped at.
    assert stop_lines(stopped)[0].startswith("stopped at step 9 (SIGTERM), checkpoint written"), stopped.stdout
    assert "error:" not in stopped.stderr  # no rank was left waiting for the other
    state = newest_checkpoint(tmp_path / "one-rank-checkpoints")
    assert (state["global_step"], len(state["ranks"])) == (9, 2)

    assert_ok(run_torchrun("step4_ddp.py", *command))
    assert_same_weights(saved_weights(tmp_path, "one-rank"), uninterrupted["ddp"])


@pytest.mark.slow
def test_a_signal_at_the_last_step_of_an_epoch_stops_after_its_evaluation(uninterrupted, tmp_path):
    """Asked during step 5 of a 6-step epoch: the stop lands on step 6, the epoch's last, so the epoch's
    evaluation and checkpoint come first; a single process signals itself."""
    command = (*RUN, *run_outputs(tmp_path, "epoch-end"), "--resume", "--fault", "sigterm", "--fault-step", 5, *GRACE)
    stopped = run_python("step1_baseline.py", *command)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout + stopped.stderr
    assert "fault drill: rank 0 sends SIGTERM to itself after step 5" in stopped.stdout
    assert "epoch 1/2" in stopped.stdout and "epoch 2/2" not in stopped.stdout
    assert stop_lines(stopped)[0].startswith("stopped at step 6 (SIGTERM), checkpoint written")
    state = newest_checkpoint(tmp_path / "epoch-end-checkpoints")
    assert (state["global_step"], state["epoch"], state["batches_done"]) == (6, 2, 0)

    assert_ok(run_python("step1_baseline.py", *command))
    assert_same_weights(saved_weights(tmp_path, "epoch-end"), uninterrupted["single"])


@pytest.mark.slow
def test_a_stop_file_stops_the_run_after_one_more_step_with_status_0(uninterrupted, tmp_path):
    """STOP in the checkpoint folder (what the Slurm jobs write on their warning signal): the run trains a
    step, stops after the next one, removes the request and exits 0, so torchrun restarts nothing."""
    folder = tmp_path / "requested-checkpoints"
    folder.mkdir()
    (folder / "STOP").touch()
    command = (*RUN, *run_outputs(tmp_path, "requested"), "--resume")
    stopped = run_torchrun("step4_ddp.py", *command, launcher=("--max-restarts=1",))
    assert_ok(stopped)
    assert stop_lines(stopped)[0].startswith(f"stopped at step 2 (asked by {folder / 'STOP'}), checkpoint written")
    assert not (folder / "STOP").exists() and graceful_stop.note(folder) == ("stop-request", 2)
    assert stopped.stdout.count("pre-flight all_reduce ok") == 1  # status 0: torchrun restarted nothing

    assert_ok(run_torchrun("step4_ddp.py", *command))
    assert_same_weights(saved_weights(tmp_path, "requested"), uninterrupted["ddp"])


# ---------------------------------------------------------------- plain torchrun restarts

@pytest.mark.slow
def test_plain_torchrun_restarts_a_killed_worker_ten_times_and_the_run_ends_with_the_same_weights(
        uninterrupted, tmp_path):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, torchrun hands every restarted group the store of the
    attempt before (pytorch/pytorch#167288): each restarted worker moves its attempt onto a store of its own.
    Rank 1 is SIGKILLed once per attempt, after steps 2, 3, ..., 11; the eleventh attempt finishes."""
    env = script_env()  # no restarts asked for: the variable is not set, as on a plain torchrun line
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env
    done = run_torchrun("step4_ddp.py", *RUN, *run_outputs(tmp_path, "killed"), "--checkpoint-every", 1, "--resume",
                        "--fault", "kill", "--fault-rank", 1, "--fault-step", 2, "--fault-every-attempt",
                        launcher=("--max-restarts=10",), env=env, timeout=900)
    assert_ok(done)
    kills = [line for line in done.stdout.splitlines() if line.startswith("fault drill: rank 1 kills itself")]
    assert kills == [f"fault drill: rank 1 kills itself (SIGKILL) after step {step}" for step in range(2, 12)]
    resumed = [int(line.split("checkpoint-")[1][:8]) for line in done.stdout.splitlines()
               if line.startswith("resumed from ")]
    # Each restarted group resumed from the newest checkpoint by its kill: the killed step's own, or the one before
    # when rank 0 was stopped while it still wrote it (rank 1 dies as soon as it has handed over its state).
    assert len(resumed) == 10 and all(step - 1 <= at <= step for at, step in zip(resumed, range(2, 12))), resumed
    assert done.stdout.count("pre-flight all_reduce ok") == 11  # the first attempt and 10 restarted groups
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in done.stderr  # no attempt ended with the fix line
    assert_same_weights(saved_weights(tmp_path, "killed"), uninterrupted["ddp"])


def test_a_restarted_worker_that_finds_no_store_of_its_attempt_stops_within_the_timeout_with_the_fix(monkeypatch):
    """Rank 1 of a restarted group whose rank 0 never posts its store (agents on several nodes that counted
    their restarts differently): one line that names the fix, after --timeout, never a silent wait."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setattr(launch_checks, "_FRESH_STORE", [])
    started = time.monotonic()
    with pytest.raises(CourseError) as raised:
        launch_checks.meet_on_a_fresh_store(timeout=2)
    assert 2 <= time.monotonic() - started  # it waited the timeout for rank 0, no less
    assert "found no store of this attempt within 2 s" in str(raised.value)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(raised.value)
    assert os.environ["MASTER_PORT"] == str(agent_store.port)  # nothing changed


def test_rank_0_of_a_restarted_group_posts_a_store_of_its_own_that_the_others_find(monkeypatch):
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent_store.port), RANK="0", WORLD_SIZE="2",
                            TORCHELASTIC_RESTART_COUNT="3", TORCHELASTIC_USE_AGENT_STORE="True").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_checks, "_FRESH_STORE", [])
    launch_checks.meet_on_a_fresh_store(timeout=5)
    port = int(os.environ["MASTER_PORT"])
    assert port != agent_store.port and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert agent_store.get("course/attempt-3/store-port") == str(port).encode()
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("reached", "yes")
    assert launch_checks._FRESH_STORE[0].get("reached") == b"yes"


# ---------------------------------------------------------------- bad inputs: one line before training

@pytest.mark.slow
def test_a_time_budget_that_cannot_hold_a_step_is_one_line_on_every_rank_before_training(tmp_path):
    done = run_torchrun("step4_ddp.py", *RUN, *run_outputs(tmp_path, "short"), "--stop-after", "0:00:01")
    assert_one_line_error(done, "--stop-after 0:00:01 leaves no time for a step: this run started",
                          "(--stop-margin)", "ask for a longer walltime")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    # Both ranks found it and raise the same line (fail_together: "[and on 1 more rank(s)]"); the second rank's
    # print may not come, since torchrun stops the rest of the group once the first rank has exited.
    assert errors and len(set(errors)) == 1 and errors[0].endswith("[and on 1 more rank(s)]"), errors
    assert "epoch 1/" not in done.stdout and not checkpoints.checkpoints_in(tmp_path / "short-checkpoints")


@pytest.mark.slow
def test_a_grace_period_shorter_than_a_checkpoint_is_one_line_before_training(tmp_path):
    done = run_python("step1_baseline.py", *RUN, *run_outputs(tmp_path, "grace"), "--grace-period", "0.000001")
    assert_one_line_error(done, "a checkpoint of this run takes about", "longer than the 1e-06 s between a "
                          "scheduler's stop signal and its SIGKILL (--grace-period)", "kill_delay", "KillWait")
    assert "epoch 1/" not in done.stdout


@pytest.mark.parametrize("value", ["soon", "1:2:3:4", "0"])
def test_a_stop_after_that_is_not_a_duration_is_refused_by_the_parser(value, capsys):
    """The scripts' own parser (cli.parse_args, which cli.run calls before main), here in this process: argparse's
    usage line and status 2, never the duration's ValueError as a traceback. A refusal by a launched script is
    checked below (--start-over with --resume)."""
    with pytest.raises(SystemExit) as refused:
        cli.parse_args(["--stop-after", value])
    assert refused.value.code == 2 and "--stop-after" in capsys.readouterr().err


def test_durations_read_as_a_scheduler_writes_them():
    assert [walltime.duration(text) for text in ("90", "1:30", "01:30:00", "0:00:05")] == [90, 90, 5400, 5]
    assert walltime.clock(5400) == "1:30:00"


# ---------------------------------------------------------------- starting over on purpose

@pytest.mark.slow
def test_start_over_moves_an_unfinished_run_aside_and_starts_fresh(uninterrupted, tmp_path):
    command = (*RUN, *run_outputs(tmp_path, "again"))
    stopped = run_python("step1_baseline.py", *command, "--fault", "sigterm", "--fault-step", 3, *GRACE)
    assert stopped.returncode == 128 + signal.SIGTERM
    folder = tmp_path / "again-checkpoints"
    kept = {path.name: path.read_bytes() for path in checkpoints.checkpoints_in(folder)}
    assert set(kept) == {"checkpoint-00000004.pt"}

    refused = run_python("step1_baseline.py", *command)
    assert_one_line_error(refused, "holds an unfinished run (at epoch 1, step 4)", "add --resume", "--start-over")

    fresh = run_python("step1_baseline.py", *command, "--start-over")
    assert_ok(fresh)
    aside = [path for path in folder.iterdir() if path.name.startswith("set-aside-")]
    assert len(aside) == 1 and (f"starting over: the earlier run's 1 checkpoint(s) were moved to {aside[0]}"
                                in fresh.stdout)
    assert {path.name: path.read_bytes() for path in aside[0].iterdir()} == kept  # moved, not deleted
    assert "resumed" not in fresh.stdout
    assert_same_weights(saved_weights(tmp_path, "again"), uninterrupted["single"])


@pytest.mark.slow
def test_start_over_and_resume_exclude_each_other():
    done = run_python("step1_baseline.py", "--resume", "--start-over")
    assert done.returncode == 2 and "--start-over and --resume exclude each other" in done.stderr
    assert "Traceback" not in done.stderr  # the parser's refusal, as a user typing it sees it


def lines_until(process, text):
    """Read ``process``'s output until a line holds ``text``; the lines read."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"the run ended before printing {text!r}:\n{''.join(lines)}")


@pytest.mark.slow
def test_a_stuck_process_ends_itself_after_sigterm(tmp_path):
    """SIGTERM reaches a process that cannot stop (stalled after step 2 for ten minutes): it ends itself
    (SIGALRM), as SIGTERM alone would have ended it, 10 s on without --grace-period (torchrun would wait 30 s
    before its SIGKILL, and only then restart the group). torch's threads may be handed the signal instead of the
    sleeping main thread; the alarm is armed all the same (signals.watch_for_sigterm)."""
    command = [PYTHON, str(SCRIPTS / "step1_baseline.py"), *map(str, RUN), *map(str, run_outputs(tmp_path, "stuck")),
               "--fault", "stall", "--fault-step", "2", "--fault-seconds", "600"]
    stuck = subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lines_until(stuck, "fault drill: rank 0 stalls")
    stuck.send_signal(signal.SIGTERM)
    stuck.communicate(timeout=120)  # a hang guard: the stall alone would last ten minutes
    assert stuck.returncode == -signal.SIGALRM  # only the alarm the SIGTERM armed sends it


def wait_until_in_a_collective(pid, give_up_s=120):
    """Poll py-spy's dump of process ``pid`` until its main thread is inside a torch.distributed call in two dumps
    in a row: the wait that lasts, not a brief collective on its way."""
    give_up, seen = time.monotonic() + give_up_s, 0  # a hang guard: the drill makes the wait last ten minutes
    while seen < 2:
        text = rank_stacks.dump(pid)
        assert not text.startswith("py-spy failed"), text
        seen = seen + 1 if rank_stacks.waits_in_a_collective(rank_stacks.main_thread(text)) else 0
        assert time.monotonic() < give_up, f"not in a collective after {give_up_s} s:\n{text}"
        time.sleep(0.2)


# Imported by every process at start-up (PYTHONPATH): py-spy, started by this test and not by an ancestor of the
# ranks, may then read them where Yama's ptrace_scope is 1 (demos/hangs.py, allow_py_spy, says more).
ALLOW_PY_SPY = "import ctypes\nctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER_ANY\n"


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_ends_itself_after_sigterm(tmp_path):
    """Rank 1 stalls after step 2 for ten minutes, so rank 0 waits in the all_reduce of step 3 (step2_allreduce.py
    averages gradients by hand) inside gloo, where Python runs no signal handler; --timeout 600 keeps it there. Once
    py-spy shows it waiting, SIGTERM to rank 0 alone, as a scheduler's reaches a worker: it ends itself by the
    alarm the SIGTERM armed (--grace-period 3 sets it 2 s on), and torchrun names it as the root cause, exit code
    -14 (SIGALRM)."""
    (tmp_path / "allow_py_spy").mkdir()
    (tmp_path / "allow_py_spy" / "sitecustomize.py").write_text(ALLOW_PY_SPY)
    command = torchrun_command("step2_allreduce.py", *RUN, *run_outputs(tmp_path, "stuck"), "--grace-period", 3,
                               "--timeout", 600, "--fault", "stall", "--fault-rank", 1, "--fault-step", 2,
                               "--fault-seconds", 600)
    env = script_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "allow_py_spy"),
                                                               os.environ.get("PYTHONPATH")])))
    group = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = {}
    try:
        lines_until(group, "fault drill: rank 1 stalls")
        ranks = rank_stacks.workers(group.pid)
        wait_until_in_a_collective(ranks[0])
        os.kill(ranks[0], signal.SIGTERM)
        output = group.communicate(timeout=120)[0]  # a hang guard: the stall and the wait last ten minutes
    except subprocess.TimeoutExpired:
        raise AssertionError("the group did not end within 120 s of rank 0's SIGTERM") from None
    finally:
        if group.poll() is None:  # the workers too: torchrun starts each in a session of its own
            for pid in [*ranks.values(), group.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        group.wait()
    root_cause = output.split("Root Cause")[-1]
    assert re.search(r"rank\s+: 0 ", root_cause) and re.search(r"exitcode\s+: -14\b", root_cause), output[-3000:]
