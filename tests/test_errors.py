"""Bad input gets one clear line naming the fix and a non-zero exit, never a traceback.

Where the check is no business of several ranks, the DDP script runs under plain python, a world of one
(each process costs seconds of CPU before its first line); torchrun's two processes stay where the claim
is about every rank, or about torchrun itself.
"""
import io
import os
import re
import shutil
import signal
import subprocess

import pytest

from helpers import (
    PYTHON,
    REPO,
    SCRIPTS,
    assert_one_line_error,
    error_lines,
    output_folders,
    reserved_port,
    run_python,
    run_torchrun,
    script_env,
)
from machinery import cli


@pytest.mark.slow
def test_missing_full_mnist_names_the_download_command(tmp_path):
    done = run_python("step1_baseline.py", "--dataset", "mnist", "--data-dir", tmp_path, "--epochs", 1)
    assert_one_line_error(done, "mnist not found", "python scripts/tools/download_data.py mnist")


def test_unknown_dataset_lists_the_choices():
    assert_one_line_error(run_python("step1_baseline.py", "--dataset", "imagenet"), "mnist5k", "mnist")


@pytest.mark.slow
def test_cuda_asked_for_without_a_gpu():
    assert_one_line_error(run_python("step1_baseline.py", "--device", "cuda"), "--device cpu")


@pytest.mark.slow
def test_nccl_asked_for_on_cpu():
    assert_one_line_error(run_python("step4_ddp.py", "--backend", "nccl", "--device", "cpu"), "--backend gloo")


@pytest.mark.slow
def test_a_gloo_interface_this_host_lacks():
    """Gloo alone would end in a C++ enforce failure and a traceback, on every rank."""
    done = run_torchrun("step4_ddp.py", "--max-steps", "1", env=script_env(GLOO_SOCKET_IFNAME="nope0"))
    assert_one_line_error(done, "GLOO_SOCKET_IFNAME=nope0 names no interface of this host", "lo")
    assert len(set(error_lines(done))) == 1  # each rank that got to say it, the same line


@pytest.mark.slow
def test_single_process_script_under_torchrun_with_two_processes():
    assert_one_line_error(run_torchrun("step1_baseline.py"), "start it with python")


class CountedWrites(io.RawIOBase):
    """A raw stream that keeps each write it is given, as a pipe sees them."""

    def __init__(self):
        self.writes = []

    def writable(self):
        return True

    def write(self, data):
        self.writes.append(bytes(data))
        return len(data)


def unbuffered_stderr():
    """sys.stderr as Python makes it under PYTHONUNBUFFERED=1: text written through to a raw stream."""
    raw = CountedWrites()
    return io.TextIOWrapper(raw, encoding="utf-8", write_through=True), raw


def test_an_error_line_leaves_a_rank_in_one_write():
    """Ranks share one log. With PYTHONUNBUFFERED=1, print() writes a line and its newline in two calls, and
    another rank's line can land between them; cli.run makes each line one write."""
    stream, raw = unbuffered_stderr()
    print("error: rank 0", file=stream, flush=True)
    assert raw.writes == [b"error: rank 0", b"\n"]  # the hazard, without the fix
    cli.write_whole_lines(stream)
    print("error: rank 1", file=stream, flush=True)
    assert raw.writes[2:] == [b"error: rank 1\n"]


@pytest.mark.slow
def test_a_script_run_through_cli_run_writes_whole_lines_under_pythonunbuffered():
    """cli.run, which every script's main goes through, reconfigures the process's own streams
    (script_env sets PYTHONUNBUFFERED=1, as many job environments do)."""
    probe = ("import sys\nfrom machinery import cli\n"
             "cli.run(lambda args: print(sys.stdout.line_buffering, sys.stderr.line_buffering,"
             " sys.stderr.write_through))")
    done = subprocess.run([PYTHON, "-c", probe], cwd=REPO, env=script_env(PYTHONPATH=SCRIPTS), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False"]


@pytest.mark.parametrize("flag", ["--epochs", "--batch-size"])
def test_non_positive_numbers_are_refused_by_the_parser(flag, capsys):
    """The parser every training script reads its command line with (cli.parse_args, its first call), here in
    this process: argparse's usage error, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_args([flag, "0"])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "must be at least 1" in stderr and "Traceback" not in stderr


# ---------------------------------------------------------------- caught before any training
# Each of these must fail before the first epoch ("epoch 1/" never printed) and lose nothing.

SHORT = ("--epochs", 1, "--max-steps", 2)


def assert_no_training(done):
    assert "epoch 1/" not in done.stdout, done.stdout


@pytest.mark.slow
def test_results_dir_that_is_a_file(tmp_path):
    """Rank 0 alone checks the output folders; under torchrun its refusal reaches every rank (the line names
    the rank it came from)."""
    (tmp_path / "taken").write_text("a file\n")
    done = run_torchrun("step4_ddp.py", *SHORT, "--checkpoint-dir", tmp_path / "c", "--results-dir", tmp_path / "taken")
    assert_one_line_error(done, "--results-dir", "is a file, not a folder")
    assert error_lines(done)[0].startswith("error: rank 0 ("), error_lines(done)
    assert_no_training(done)


@pytest.mark.slow
def test_checkpoint_dir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file\n")
    done = run_python("step1_baseline.py", *SHORT, "--results-dir", tmp_path / "r",
                      "--checkpoint-dir", tmp_path / "taken")
    assert_one_line_error(done, "--checkpoint-dir", "is a file, not a folder")
    assert_no_training(done)


@pytest.mark.slow
def test_save_path_that_is_a_folder(tmp_path):
    done = run_python("step1_baseline.py", *SHORT, *output_folders(tmp_path), "--save", tmp_path)
    assert_one_line_error(done, "--save", "is a folder")
    assert_no_training(done)


@pytest.mark.slow
def test_save_path_that_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("not a folder\n")
    done = run_python("step4_ddp.py", *SHORT, *output_folders(tmp_path),
                      "--save", tmp_path / "file" / "sub" / "weights.pt")
    assert_one_line_error(done, "--save's folder", "cannot be created")
    assert_no_training(done)


@pytest.mark.slow
def test_rank_set_without_the_rest_of_torchruns_variables():
    done = run_python("step4_ddp.py", *SHORT, env=script_env(RANK=0))
    assert_one_line_error(done, "RANK set but not", "MASTER_ADDR", "start the script with torchrun")


@pytest.mark.slow
def test_inconsistent_world_size():
    env = script_env(RANK=3, LOCAL_RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=29999)
    assert_one_line_error(run_python("step4_ddp.py", *SHORT, env=env), "inconsistent torchrun variables", "RANK=3")


@pytest.mark.slow
def test_a_truncated_data_file_is_reported_as_damaged_not_missing(tmp_path):
    raw = tmp_path / "mnist5k" / "MNIST" / "raw"
    shutil.copytree(REPO / "data" / "mnist5k" / "MNIST" / "raw", raw)
    images = raw / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:100_000])
    done = run_python("step1_baseline.py", *SHORT, *output_folders(tmp_path), "--data-dir", tmp_path)
    assert_one_line_error(done, "is damaged", "git checkout -- data/")
    assert "not found" not in done.stderr


def finish_a_run(launch, folder):
    """A finished run with its checkpoints, steps 2 (mid-epoch) and 3 (end), and its final weights."""
    done = launch("step4_ddp.py", "--epochs", 1, "--max-steps", 3, "--checkpoint-every", 2,
                  "--batch-size", 32, *output_folders(folder), "--save", folder / "weights.pt")
    assert "epoch 1/1" in done.stdout, done.stderr
    return folder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-process run (torchrun): for the checks about a world of two."""
    return finish_a_run(run_torchrun, tmp_path_factory.mktemp("finished"))


@pytest.fixture(scope="module")
def finished_alone(tmp_path_factory):
    """The same run in a world of one (python step4_ddp.py): a later python run differs from it only in what
    a test changes."""
    return finish_a_run(run_python, tmp_path_factory.mktemp("finished-alone"))


def damaged_copy(finished_run, tmp_path, damage):
    """The finished run's checkpoints, with the newest one damaged by ``damage(bytes)``."""
    folder = tmp_path / "checkpoints"
    shutil.copytree(finished_run / "checkpoints", folder)
    newest = folder / "checkpoint-00000003.pt"
    newest.write_bytes(damage(newest.read_bytes()))
    return folder, newest


@pytest.mark.parametrize("damage", [lambda data: data[: len(data) // 3], lambda data: b"\x00garbage" * 1000],
                         ids=["truncated", "corrupt"])
@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_and_kept(finished_alone, tmp_path, damage):
    folder, newest = damaged_copy(finished_alone, tmp_path, damage)
    before = newest.read_bytes()
    done = run_python("step4_ddp.py", "--epochs", 2, "--max-steps", 3, "--batch-size", 32,
                      "--checkpoint-dir", folder, "--results-dir", tmp_path / "r", "--resume")
    assert_one_line_error(done, "checkpoint-00000003.pt cannot be read", "move it out of the folder")
    assert_no_training(done)
    assert newest.read_bytes() == before and (folder / "checkpoint-00000002.pt").exists()  # nothing lost


@pytest.mark.slow
def test_a_weights_file_given_to_resume_is_not_a_checkpoint(finished_alone, tmp_path):
    done = run_python("step4_ddp.py", *SHORT, "--batch-size", 32, *output_folders(tmp_path),
                      "--resume", finished_alone / "weights.pt")
    assert_one_line_error(done, "is not a checkpoint of this course")
    assert_no_training(done)


# Each later run is one process, and differs from the finished run it resumes in one setting only: the world
# size (the 2-process run), or what it passes (the run of one process).
@pytest.mark.parametrize("finished, extra, difference", [
    ("finished_run", ("--batch-size", 32), "world_size 2 -> 1"),
    ("finished_alone", ("--batch-size", 64), "batch_size 32 -> 64"),
    ("finished_alone", ("--batch-size", 32, "--optimizer", "sgd"), "optimizer adam -> sgd"),
    ("finished_alone", ("--batch-size", 32, "--model", "net-bn"), "model net -> net-bn"),
    # The Net takes MNIST's 1x28x28 images only: a CIFAR-shaped data set comes with the ResNet for CIFAR.
    ("finished_alone", ("--batch-size", 32, "--dataset", "synthetic-cifar10", "--model", "resnet18-cifar"),
     "dataset mnist5k -> synthetic-cifar10"),
], ids=["world size", "batch size", "optimizer", "model", "data set"])
@pytest.mark.slow
def test_a_checkpoint_of_another_run_says_what_differs(request, tmp_path, finished, extra, difference):
    folder = tmp_path / "checkpoints"
    shutil.copytree(request.getfixturevalue(finished) / "checkpoints", folder)
    done = run_python("step4_ddp.py", "--epochs", 2, *extra, "--checkpoint-dir", folder,
                      "--results-dir", tmp_path / "r", "--resume")
    assert_one_line_error(done, "is from another run", difference)
    assert_no_training(done)


@pytest.mark.slow
def test_ranks_that_see_different_checkpoints_stop_together_before_training(finished_run, tmp_path):
    """Two torchrun agents, one per 'node', each in its own working directory with the same relative
    --checkpoint-dir, as on two nodes without a shared file system: node 0's folder holds the finished
    run's checkpoints, node 1's is empty. Rank 0 alone would resume; every rank stops instead, with the
    same line. (torchrun's static rendezvous keeps --node-rank, so rank 1 is the node without them.)"""
    nodes = []
    with reserved_port() as port:
        for rank in (0, 1):
            home = tmp_path / f"node{rank}"
            (home / "checkpoints").mkdir(parents=True)
            if rank == 0:
                shutil.copytree(finished_run / "checkpoints", home / "checkpoints", dirs_exist_ok=True)
            command = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1",
                       "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPTS / "step4_ddp.py"),
                       "--epochs", "2", "--max-steps", "3", "--batch-size", "32", "--timeout", "30",
                       "--checkpoint-dir", "checkpoints", "--results-dir", "results", "--resume"]
            nodes.append(subprocess.Popen(command, cwd=home, env=script_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        try:
            results = [process.communicate(timeout=180) for process in nodes]
        finally:  # ranks that trained apart can leave an agent waiting for the other at exit: end it and its worker
            for process in nodes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    messages = []
    for process, (stdout, stderr) in zip(nodes, results):
        assert process.returncode != 0, stdout + stderr[-3000:]
        assert not re.search(r"^epoch \d+/", stdout, re.MULTILINE) and "resumed from" not in stdout, stdout
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert lines, stderr[-3000:]
        messages.append(lines[0])
    assert messages[0] == messages[1]  # both nodes say the same, at once
    node0, node1 = ((tmp_path / f"node{rank}" / "checkpoints").resolve() for rank in (0, 1))
    assert "rank 1 (" in messages[0] and f"sees no checkpoint in {node1} while rank 0 (" in messages[0], messages[0]
    assert f"resumes from {node0 / 'checkpoint-00000003.pt'} (step 3)" in messages[0], messages[0]
    assert messages[0].endswith("put --checkpoint-dir on a file system every node shares"), messages[0]


@pytest.mark.slow
def test_a_fresh_start_refuses_to_overwrite_an_unfinished_run(finished_alone, tmp_path):
    folder = tmp_path / "checkpoints"
    shutil.copytree(finished_alone / "checkpoints", folder)
    (folder / "checkpoint-00000003.pt").unlink()  # the newest left is mid-epoch: unfinished
    done = run_python("step4_ddp.py", *SHORT, "--batch-size", 32, "--checkpoint-dir", folder,
                      "--results-dir", tmp_path / "r")
    assert_one_line_error(done, "holds an unfinished run", "add --resume")
    assert_no_training(done)
    assert (folder / "checkpoint-00000002.pt").exists()


@pytest.mark.slow
def test_a_fresh_start_replaces_a_finished_run(finished_alone, tmp_path):
    folder = tmp_path / "checkpoints"
    shutil.copytree(finished_alone / "checkpoints", folder)
    done = run_python("step4_ddp.py", "--epochs", 1, "--max-steps", 1, "--batch-size", 32,
                      "--checkpoint-dir", folder, "--results-dir", tmp_path / "r")
    assert done.returncode == 0, done.stderr
    assert "starting fresh: the finished run's checkpoints" in done.stdout
    assert [p.name for p in sorted(folder.glob("checkpoint-*.pt"))] == ["checkpoint-00000001.pt"]
