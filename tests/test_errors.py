"""Bad input gets one clear line naming the fix and a non-zero exit, never a traceback."""
import pytest

from conftest import run_python, run_torchrun


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


def test_missing_full_mnist_names_the_download_command(tmp_path):
    done = run_python("train_single.py", "--dataset", "mnist", "--data-dir", tmp_path, "--epochs", 1)
    assert_one_line_error(done, "mnist not found", "python scripts/download_data.py mnist")


def test_unknown_dataset_lists_the_choices():
    assert_one_line_error(run_python("train_single.py", "--dataset", "imagenet"), "mnist5k", "mnist")


def test_cuda_asked_for_without_a_gpu():
    assert_one_line_error(run_python("train_single.py", "--device", "cuda"), "--device cpu")


def test_nccl_asked_for_on_cpu():
    assert_one_line_error(run_torchrun("train_ddp.py", "--backend", "nccl", "--device", "cpu"), "--backend gloo")


def test_single_process_script_under_torchrun_with_two_processes():
    assert_one_line_error(run_torchrun("train_single.py"), "start it with python")


@pytest.mark.parametrize("flag", ["--epochs", "--batch-size"])
def test_non_positive_numbers_are_refused_by_the_parser(flag):
    done = run_python("train_single.py", flag, "0")
    assert done.returncode == 2 and "must be at least 1" in done.stderr and "Traceback" not in done.stderr
