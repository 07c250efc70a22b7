"""Shared fixtures: the repository's paths and a way to run scripts as a user would."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PYTHON = sys.executable


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_env(**extra):
    """The environment a launched script sees: no GPU, quiet torchrun banner, loopback only."""
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # a fresh store per torchrun restart (core.distributed)
    env.update({name: str(value) for name, value in extra.items()})
    return env


def run_python(script, *args, timeout=300, env=None):
    return subprocess.run([PYTHON, str(SCRIPTS / script), *map(str, args)], cwd=REPO, env=env or script_env(),
                          capture_output=True, text=True, timeout=timeout)


def torchrun_command(script, *args, nproc=2, launcher=()):
    """torchrun with a private rendezvous port on 127.0.0.1, so tests never collide."""
    return [PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *launcher,
            str(SCRIPTS / script), *map(str, args)]


def run_torchrun(script, *args, nproc=2, timeout=300, launcher=(), env=None):
    return subprocess.run(torchrun_command(script, *args, nproc=nproc, launcher=launcher), cwd=REPO,
                          env=env or script_env(), capture_output=True, text=True, timeout=timeout)


def assert_ok(done):
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"


def error_lines(done):
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def assert_one_line_error(done, *fragments):
    """The script's own error line, and no traceback from the script.

    Under torchrun the launcher adds one traceback of its own (ChildFailedError) after the
    children exit; that one is torchrun's, and it comes after the script's line.
    """
    assert done.returncode != 0
    if "Traceback" in done.stderr:
        assert done.stderr.count("Traceback") == 1 and "ChildFailedError" in done.stderr, done.stderr
        assert error_lines(done) and done.stderr.index("error:") < done.stderr.index("Traceback")
    lines = error_lines(done)
    assert lines, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def read_json(path):
    return json.loads(Path(path).read_text())


@pytest.fixture
def results_dir(tmp_path):
    return tmp_path / "results"
