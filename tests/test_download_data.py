"""scripts/download_data.py fails cleanly (one line, exit 1, no traceback) when it cannot reach the internet."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "download_data.py"


def unused_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_download_failure_is_one_clean_error_line(dataset, tmp_path):
    # Route urllib through a proxy on a closed local port: the download fails at once, with or without internet,
    # so the test is fast and never pulls 170 MB of CIFAR-10 on a connected machine.
    dead_proxy = f"http://127.0.0.1:{unused_local_port()}"
    env = {**os.environ, "http_proxy": dead_proxy, "https_proxy": dead_proxy, "no_proxy": "", "NO_PROXY": ""}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, str(SCRIPT), dataset, "--data-dir", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=120)
    if result.returncode == 0:
        pytest.skip(f"{dataset} downloaded anyway (the proxy was bypassed), so there is no failure to check")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    stderr_lines = result.stderr.strip().splitlines()
    assert len(stderr_lines) == 1, result.stderr
    assert stderr_lines[0].startswith(f"error: could not download {dataset} (")
    assert "login node" in stderr_lines[0]
