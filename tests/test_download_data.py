"""scripts/tools/download_data.py fails cleanly (one line, exit 1, no traceback) when it cannot reach the internet."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tools" / "download_data.py"


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


def run_download(*args, tmp_path, **env):
    """download_data.py with a dead proxy, so nothing can reach the internet, and TORCH_HOME in tmp_path."""
    dead_proxy = f"http://127.0.0.1:{unused_local_port()}"
    environment = {**os.environ, "http_proxy": dead_proxy, "https_proxy": dead_proxy, "no_proxy": "", "NO_PROXY": "",
                   "TORCH_HOME": str(tmp_path / "torch-home"), **env}
    environment.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=environment, timeout=120)


@pytest.mark.parametrize("name", ["hymenoptera", "resnet18-weights"])
def test_fine_tuning_downloads_fail_in_one_line_too(name, tmp_path):
    result = run_download(name, "--data-dir", tmp_path, tmp_path=tmp_path)
    if result.returncode == 0:
        pytest.skip(f"{name} downloaded anyway (the proxy was bypassed)")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"error: could not download {name} (") and "login node" in result.stderr


def test_the_weights_go_where_train_finetune_reads_them(tmp_path, monkeypatch):
    """The torch hub cache under TORCH_HOME: the one file both scripts name."""
    sys.path.insert(0, str(SCRIPT.parent))
    from machinery import finetune
    from tools import download_data

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    args = download_data.parse_args(["resnet18-weights"])
    expected = tmp_path / "torch-home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert download_data.destination("resnet18-weights", args) == finetune.pretrained_file() == expected
    named = download_data.parse_args(["resnet18-weights", "--weights-file", str(tmp_path / "w.pth")])
    assert download_data.destination("resnet18-weights", named) == tmp_path / "w.pth"


def test_the_ants_and_bees_go_where_the_imagefolder_default_reads_them(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import step6_finetune
    from machinery import cli
    from tools import download_data

    args = download_data.parse_args(["hymenoptera", "--data-dir", str(tmp_path)])
    assert download_data.destination("hymenoptera", args) == tmp_path / "hymenoptera_data"
    defaults = cli.parse_args(["--pretrained"], add_arguments=step6_finetune.add_arguments)
    assert defaults.data_dir == download_data.DEFAULT_DATA_DIR / "hymenoptera_data"


def test_what_is_there_already_is_not_downloaded_again(tmp_path):
    (tmp_path / "hymenoptera_data").mkdir()
    weights = tmp_path / "mine.pth"
    weights.write_bytes(b"weights")
    result = run_download("hymenoptera", "resnet18-weights", "--data-dir", tmp_path, "--weights-file", weights,
                          tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hymenoptera is there already" in result.stdout and "resnet18-weights is there already" in result.stdout
    assert f"train with: torchrun --nproc-per-node=2 scripts/step6_finetune.py --weights {weights}" in result.stdout
    assert weights.read_bytes() == b"weights"


def test_a_folder_as_weights_file_is_refused(tmp_path):
    result = run_download("resnet18-weights", "--weights-file", tmp_path, tmp_path=tmp_path)
    assert result.returncode == 2 and "is a folder; name a file" in result.stderr


def test_an_unknown_name_lists_the_choices(tmp_path):
    result = run_download("imagenet", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "hymenoptera" in result.stderr and "resnet18-weights" in result.stderr
