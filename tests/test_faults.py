"""A rank that stalls, dies or cannot start ends the whole job, fast, with a message that
says which rank and what happened: never a silent hang until some far-off timeout.

The `timeout=` of each subprocess below is a hang guard, not a speed target: a stall
drill sleeps for an hour, so finishing at all means the course's --timeout ended it.
"""
import subprocess

from conftest import PYTHON, REPO, SCRIPTS, assert_one_line_error, free_port, run_torchrun, script_env

SHORT = ("--epochs", 1, "--max-steps", 8, "--batch-size", 32)


def outputs(tmp_path):
    return ("--checkpoint-dir", tmp_path / "checkpoints", "--results-dir", tmp_path / "results")


def test_a_stalled_rank_ends_the_job_after_the_timeout_and_is_named(tmp_path):
    done = run_torchrun("train_ddp.py", *SHORT, *outputs(tmp_path), "--timeout", 5,
                        "--fault", "stall", "--fault-rank", 1, "--fault-step", 3, timeout=180)
    assert done.returncode != 0
    assert "fault drill: rank 1 stalls" in done.stdout
    # One line from the script (torchrun adds its own summary after it), naming the straggler
    # from the progress every rank posts to the shared store.
    assert_one_line_error(done, "rank 0 waited longer than --timeout 5 s in a collective", "rank 1 last reported step")


def test_a_rank_that_exits_early_ends_the_job_and_torchrun_names_it(tmp_path):
    done = run_torchrun("train_ddp.py", *SHORT, *outputs(tmp_path),
                        "--fault", "exit", "--fault-rank", 1, "--fault-step", 3, timeout=180)
    assert done.returncode != 0
    assert "fault drill: rank 1 exits with status 3 after step 3" in done.stdout
    root_cause = done.stderr.split("Root Cause")[-1]
    assert "rank      : 1" in root_cause and "exitcode  : 3" in root_cause, done.stderr[-3000:]


def test_data_missing_on_one_node_stops_every_rank_with_the_same_message(tmp_path):
    """Two torchrun agents, one per 'node', meet on loopback; node 1's --data-dir is empty.
    (torchrun's static rendezvous keeps --node-rank, so rank 1 is the node without data.)"""
    port = free_port()

    def node(rank, data_dir):
        command = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                   "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                   str(SCRIPTS / "train_ddp.py"), *map(str, SHORT), *map(str, outputs(tmp_path / f"node{rank}")),
                   "--data-dir", data_dir]
        return subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    empty = tmp_path / "empty"
    empty.mkdir()
    nodes = [node(0, REPO / "data"), node(1, empty)]
    results = [process.communicate(timeout=180) for process in nodes]
    messages = []
    for process, (stdout, stderr) in zip(nodes, results):
        assert process.returncode != 0
        assert "epoch 1/" not in stdout  # nobody started training
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert lines, stderr[-3000:]
        messages.append(lines[0])
    assert messages[0] == messages[1]  # the healthy node says the same, at once
    assert "rank 1 (" in messages[0] and "mnist5k" in messages[0] and "git checkout -- data/" in messages[0]
