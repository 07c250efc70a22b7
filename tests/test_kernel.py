"""`make kernel` registers the course's environment as the Jupyter kernel the notebooks ask for.

It runs for real, into a temporary Jupyter data folder (JUPYTER_DATA_DIR), so that the
machine's own kernels stay untouched; the kernel it registers is then started and runs code.
"""
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from jupyter_client.manager import start_new_kernel

from helpers import NOTEBOOKS, REPO


@pytest.fixture
def registered(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    done = subprocess.run(["make", "--no-print-directory", "kernel", f"PY={sys.executable}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp_path / "data" / "kernels" / "ddp-course"


def test_the_kernel_is_registered_with_this_python(registered):
    spec = json.loads((registered / "kernel.json").read_text())
    assert spec["display_name"] == "Python (ddp-course)"
    assert spec["argv"][0] == sys.executable and "ipykernel_launcher" in spec["argv"]
    listed = subprocess.run([sys.executable, "-m", "jupyter", "kernelspec", "list", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert str(registered) in json.loads(listed.stdout)["kernelspecs"]["ddp-course"]["resource_dir"]


def test_the_registered_kernel_runs_the_courses_python(registered):
    manager, client = start_new_kernel(kernel_name="ddp-course", cwd=str(REPO / "notebooks"))
    try:
        output = []
        client.execute_interactive("import sys, torch; print(sys.executable, torch.__version__)",
                                   output_hook=lambda message: output.append(message["content"].get("text", "")),
                                   timeout=120)
        import torch

        assert "".join(output).split() == [sys.executable, torch.__version__]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_a_plain_pytest_nbval_runs_the_notebooks_with_no_kernel_registered(tmp_path):
    """`pytest --nbval notebooks/` as a participant types it, on a machine where `make kernel` never ran: the
    notebooks ask for "ddp-course", which no Jupyter folder holds, and the first cell still runs (in this Python)."""
    empty = {"HOME": str(tmp_path), "JUPYTER_DATA_DIR": str(tmp_path / "data"), "JUPYTER_PATH": "",
             "IPYTHONDIR": str(tmp_path / "ipython")}
    first = f"{NOTEBOOKS[0].relative_to(REPO)}::Cell 0"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nbval", first],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **empty})
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("given, kernel, current_env, sanitizer", [
    ({}, None, True, str(REPO / "notebooks" / "sanitize.cfg")),
    ({"nbval_kernel_name": "ddp-course"}, "ddp-course", False, str(REPO / "notebooks" / "sanitize.cfg")),
    ({"nbval_sanitize_with": "mine.cfg"}, None, True, "mine.cfg"),
    ({"nbval_kernel_name": "python3", "nbval_sanitize_with": "mine.cfg"}, "python3", False, "mine.cfg")])
def test_what_the_command_line_names_wins_over_the_notebook_defaults(given, kernel, current_env, sanitizer):
    spec = importlib.util.spec_from_file_location("session_conftest", REPO / "conftest.py")
    session_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(session_conftest)  # the checkout's conftest.py, not tests/conftest.py
    option = SimpleNamespace(**{"nbval_kernel_name": None, "nbval_current_env": False,
                                "nbval_sanitize_with": None, **given})
    session_conftest.use_this_environment_for_the_notebooks(option)
    assert (option.nbval_kernel_name, option.nbval_current_env, option.nbval_sanitize_with) == (
        kernel, current_env, sanitizer)
