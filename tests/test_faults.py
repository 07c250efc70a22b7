"""A rank that stalls, dies or cannot start ends the whole job, fast, with a message that
says which rank and what happened: never a silent hang until some far-off timeout.

The `timeout=` of each subprocess below is a hang guard, not a speed target: a stall
drill sleeps for an hour, so finishing at all means the course's --timeout ended it.
"""
import datetime
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
    SCRIPTS,
    assert_one_line_error,
    output_folders,
    reserved_port,
    run_torchrun,
    script_env,
)
from kit import launch_checks
from kit.errors import CourseError
from lesson import process
from machinery import stragglers

SHORT = ("--epochs", 1, "--max-steps", 8, "--batch-size", 32)


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_after_the_timeout_and_is_named(tmp_path):
    done = run_torchrun("step4_ddp.py", *SHORT, *output_folders(tmp_path), "--timeout", 5,
                        "--fault", "stall", "--fault-rank", 1, "--fault-step", 3, timeout=180)
    assert done.returncode != 0
    assert "fault drill: rank 1 stalls" in done.stdout
    # One line from the script (torchrun adds its own summary after it), naming the straggler
    # from the progress every rank posts to the shared store.
    assert_one_line_error(done, "rank 0 waited longer than --timeout 5 s in a collective", "rank 1 last reported step")


@pytest.mark.slow
def test_a_rank_that_exits_early_ends_the_job_and_torchrun_names_it(tmp_path):
    done = run_torchrun("step4_ddp.py", *SHORT, *output_folders(tmp_path),
                        "--fault", "exit", "--fault-rank", 1, "--fault-step", 3, timeout=180)
    assert done.returncode != 0
    assert "fault drill: rank 1 exits with status 3 after step 3" in done.stdout
    root_cause = done.stderr.split("Root Cause")[-1]
    assert "rank      : 1" in root_cause and "exitcode  : 3" in root_cause, done.stderr[-3000:]


@pytest.mark.slow
def test_data_missing_on_one_node_stops_every_rank_with_the_same_message(tmp_path):
    """Two torchrun agents, one per 'node', meet on loopback; node 1's --data-dir is empty.
    (torchrun's static rendezvous keeps --node-rank, so rank 1 is the node without data.)"""
    def node(rank, data_dir, port):
        command = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                   "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                   str(SCRIPTS / "step4_ddp.py"), *map(str, SHORT), *map(str, output_folders(tmp_path / f"node{rank}")),
                   "--data-dir", data_dir]
        return subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    empty = tmp_path / "empty"
    empty.mkdir()
    with reserved_port() as port:
        nodes = [node(0, REPO / "data", port), node(1, empty, port)]
        results = [agent.communicate(timeout=180) for agent in nodes]
    messages = []
    for agent, (stdout, stderr) in zip(nodes, results):
        assert agent.returncode != 0
        assert "epoch 1/" not in stdout  # nobody started training
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert lines, stderr[-3000:]
        messages.append(lines[0])
    assert messages[0] == messages[1]  # the healthy node says the same, at once
    assert "rank 1 (" in messages[0] and "mnist5k" in messages[0] and "git checkout -- data/" in messages[0]


# ---------------------------------------------------------------- naming the rank behind, in one process

TIMED_OUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms "
                         "for recv operation to complete")


@pytest.fixture
def two_ranks(monkeypatch):
    """Progress of rank 0 and rank 1 of a world of 2, on a real store in this process, as torchrun's."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    ranks = [stragglers.StragglerWatch(process.Runtime(rank, rank, 2, 1, torch.device("cpu"), "gloo", 1,
                                                      datetime.timedelta(seconds=5))) for rank in (0, 1)]
    yield ranks
    for progress in ranks:
        progress.close()


# What the Trainer posts, in order, over an epoch of 3 steps and into step 4: (steps done, phase).
POSTS = [(0, "starting"), (0, "training"), (1, "between steps"), (1, "training"), (2, "between steps"),
         (2, "training"), (3, "between steps"), (3, "ending the epoch"), (3, "training")]


@pytest.mark.parametrize("stopped_at, named", [
    ((3, "between steps"), True),  # stalled after step 3: its last position says step 3, as the waiter's does
    ((3, "ending the epoch"), True),  # still ending epoch 1 (rank 0 writing its checkpoint, say)
    ((2, "training"), True),  # stuck in step 3, before its collective
    ((3, "training"), False),  # waiting in step 4's collective too: not behind
    ((3, "finished"), True),  # a run told fewer epochs: it joins no collective any more
], ids=["between steps", "ending the epoch", "in the step before", "in the same step", "finished"])
def test_the_rank_behind_is_named_however_long_the_steps(two_ranks, stopped_at, named):
    """Rank 0 waits in step 4's collective; rank 1 went as far as ``stopped_at`` and no further. The
    positions reach the store from a thread (within StragglerWatch.INTERVAL on a machine that runs it), so
    this holds for steps of any length, also when both ranks' last writes say step 3."""
    waiter, other = two_ranks
    for step, phase in POSTS:
        waiter.post(step, phase, now=phase == "starting")
    mine = POSTS[:POSTS.index(stopped_at) + 1] if stopped_at in POSTS else [*POSTS[:-2], stopped_at]
    for step, phase in mine:
        other.post(step, phase, now=phase == "starting")
    # No more posts: rank 1 is stuck, rank 0 waits. Rank 1's writer thread, not this test, brings its last
    # position to the store; wait until it has (however long a loaded machine keeps the thread waiting).
    while other.written != other.position and other.store is not None:
        time.sleep(stragglers.StragglerWatch.INTERVAL)
    line = waiter.explain_collective_failure(TIMED_OUT)  # in step 4, after 3 steps done
    assert line.startswith("rank 0 waited longer than --timeout 5 s in a collective at step 3: "), line
    if named:
        assert re.search(rf"rank 1 last reported step {stopped_at[0]} \d+ s ago \({stopped_at[1]}\)", line), line
    else:
        assert "the other ranks' progress is unknown" in line, line


# Rank 1 of a 2-rank group started by torchrun without restarts, on an agent store the test holds: what a
# worker sees when it shares torchrun's store (launch_checks.wait_for_every_rank meets the ranks there).
RANK_1_OF_2 = dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_USE_AGENT_STORE="True")
MEETING_COUNT = "course/2-ranks-started/count"


def test_a_rank_that_the_others_never_join_stops_with_one_line_naming_them_after_its_wait(monkeypatch):
    """No rank 0 ever reaches the meeting (stuck on a file system, say): rank 1 waits --timeout or START_WAIT_S,
    whichever is longer, then stops with one line that names the rank missing."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in dict(RANK_1_OF_2, MASTER_PORT=str(agent_store.port)).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_checks, "START_WAIT_S", 1)  # the floor, not to wait 300 s here
    started = time.monotonic()
    with pytest.raises(CourseError) as raised:
        launch_checks.wait_for_every_rank(timeout=2)
    assert 2 <= time.monotonic() - started  # it waited --timeout for rank 0, no less
    assert str(raised.value).startswith("rank 1: rank(s) 0 of 2 did not start within 2 s"), raised.value
    assert agent_store.add(MEETING_COUNT, 0) == 1  # rank 1 checked in, alone


def rank_1_waiting_in_the_meeting(agent_store):
    """Rank 1 as a process of its own, through cli.run, once it waits in the meeting for a rank 0 that never
    comes (--timeout 3: its wait is START_WAIT_S, 300 s)."""
    code = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); from machinery import cli; "
            "cli.run(lambda args: None, ['--timeout', '3', '--grace-period', '30'])")
    rank = subprocess.Popen([PYTHON, "-c", code], cwd=REPO, env=script_env(**RANK_1_OF_2, MASTER_PORT=agent_store.port),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checked_in = time.monotonic() + 120  # a hang guard: importing torch on a busy machine
    while agent_store.add(MEETING_COUNT, 0) == 0 and rank.poll() is None:
        if time.monotonic() > checked_in:
            rank.kill()
        time.sleep(0.1)
    assert rank.poll() is None, rank.communicate()  # it waits in the meeting
    return rank


def one_line_from(rank):
    try:
        stdout, stderr = rank.communicate(timeout=60)  # far less than its 300 s wait, or the SIGALRM 29 s away
    finally:
        rank.kill()
        rank.wait()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert rank.returncode == 1 and len(errors) == 1 and "Traceback" not in stderr, (rank.returncode, stderr)
    return errors[0]  # torch's own C++ warnings (a lost connection) may come before it


def test_a_rank_waiting_for_the_others_to_start_stops_at_once_on_sigterm():
    """torchrun stops a group whose rank failed at start with SIGTERM: a rank waiting in the meeting leaves
    at once, with one line, instead of after its wait or its --grace-period."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank = rank_1_waiting_in_the_meeting(agent_store)
    rank.send_signal(signal.SIGTERM)
    assert one_line_from(rank) == "error: rank 1: SIGTERM came while it waited for the other ranks to start"


def test_a_rank_whose_store_goes_away_during_the_meeting_stops_with_one_line():
    """The node that hosts torchrun's store ends (its agent exits): the others say so in one line."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank = rank_1_waiting_in_the_meeting(agent_store)
    port = agent_store.port
    del agent_store  # the store's server goes with it
    line = one_line_from(rank)
    assert line.startswith(f"error: rank 1 lost, or could not reach, torchrun's store at 127.0.0.1:{port}"), line
