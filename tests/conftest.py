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


def script_env():
    """The environment a launched script sees: no GPU, quiet torchrun banner, loopback only."""
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_python(script, *args, timeout=300):
    return subprocess.run([PYTHON, str(SCRIPTS / script), *map(str, args)], cwd=REPO, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


def run_torchrun(script, *args, nproc=2, timeout=300):
    """torchrun with a private rendezvous port on 127.0.0.1, so tests never collide."""
    command = [PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               str(SCRIPTS / script), *map(str, args)]
    return subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=timeout)


def assert_ok(done):
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"


def read_json(path):
    return json.loads(Path(path).read_text())


@pytest.fixture
def results_dir(tmp_path):
    return tmp_path / "results"
