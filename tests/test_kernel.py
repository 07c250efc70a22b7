"""`make kernel` registers the course's environment as the Jupyter kernel the notebooks ask for.

It runs for real, into a temporary Jupyter data folder (JUPYTER_DATA_DIR), so that the
machine's own kernels stay untouched; the kernel it registers is then started and runs code.
"""
import json
import subprocess
import sys

import pytest
from jupyter_client.manager import start_new_kernel

from helpers import REPO


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
