"""kit/exactness.py: the one switch that turns off what a GPU changes by default (TF32, cuDNN's nondeterministic and
timed algorithms) for the runs the course compares to 1e-6, and the code that must apply it in the processes that
compute. The flags only govern CUDA libraries, so a CPU reads and writes them all the same.

Every test starts from the opposite of each flag, so a flag the switch forgot is still wrong after it, and puts the
process's flags back after it. tests/test_equivalence.py checks the flags in the two processes of a real run.
"""
import argparse

import pytest
import torch

from kit import exactness, mfu

# The opposite of every flag exact_math() sets, as math_settings() names them. The older allow_tf32 flags go first:
# setting them resets the per-operator ones, and PyTorch raises on reading them when the two disagree.
OPPOSITE = {
    "cuda_matmul_allow_tf32": True,
    "cudnn_allow_tf32": True,
    "cuda_matmul_fp32_precision": "tf32",
    "cudnn_conv_fp32_precision": "tf32",
    "cudnn_rnn_fp32_precision": "tf32",
    "cudnn_benchmark": True,
    "cudnn_deterministic": False,
}


def put(flags):
    """Set this process's flags to ``flags`` (math_settings() names; float32_matmul_precision follows the matmul's)."""
    torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    torch.backends.cuda.matmul.fp32_precision = flags["cuda_matmul_fp32_precision"]
    torch.backends.cudnn.conv.fp32_precision = flags["cudnn_conv_fp32_precision"]
    torch.backends.cudnn.rnn.fp32_precision = flags["cudnn_rnn_fp32_precision"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]


@pytest.fixture
def from_the_opposite():
    """Every flag the opposite of exact_math()'s for the test; this process's own flags again after it."""
    before = exactness.math_settings()
    put(OPPOSITE)
    yield
    put(before)
    assert exactness.math_settings() == before


def test_the_opposite_differs_from_the_switch_in_every_flag(from_the_opposite):
    """Else a flag that exact_math() forgot could read right by chance below."""
    now = exactness.math_settings()
    assert now.keys() == exactness.EXACT.keys()
    assert [name for name in now if now[name] == exactness.EXACT[name]] == []


def test_exact_math_sets_every_flag(from_the_opposite):
    assert exactness.exact_math() == exactness.EXACT == exactness.math_settings()
    # Read from torch itself, not through math_settings():
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cudnn.conv.fp32_precision == torch.backends.cudnn.rnn.fp32_precision == "ieee"
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True


def test_the_records_tf32_settings_stay_readable_after_it(from_the_opposite):
    """kit/mfu.py reads the older allow_tf32 flags for every run's record; after the newer API alone PyTorch raises
    on that read ("a mix of the legacy and new APIs"), so exact_math() sets both."""
    exactness.exact_math()
    assert mfu.tf32_settings() == {"cudnn_conv_tf32": False, "cuda_matmul_tf32": False,
                                   "float32_matmul_precision": "highest"}


def test_is_exact_finds_one_flag_left_as_it_was():
    for name in exactness.EXACT:
        assert not exactness.is_exact({**exactness.EXACT, name: OPPOSITE.get(name, "high")}), name
    assert exactness.is_exact(dict(exactness.EXACT))


class Stopped(Exception):
    """verify_equivalence.main stopped where its processes would start to compute."""


def test_every_demo_applies_it_before_its_process_starts(from_the_opposite, monkeypatch):
    """What the flags are when the demos' one set-up call (verify_equivalence's included) reaches this process's
    device and process group: the switch runs in the script's own process (each torchrun'd rank), not in whoever
    launched it."""
    from demos import runner

    seen = []

    def this_process(args):
        seen.append(exactness.math_settings())
        raise Stopped

    monkeypatch.setattr(runner.process, "this_process", this_process)
    with pytest.raises(Stopped):
        runner.setup(argparse.Namespace())
    assert seen == [exactness.EXACT]


def test_gpu_check_judges_the_flags_of_every_process():
    """make gpu-check's equivalence step passes only when the record shows the switch in all its processes."""
    from tools import gpu_check

    exact = dict(exactness.EXACT)
    assert gpu_check.exact_in_every_process({"math_settings": [exact, exact]}, 2)
    assert not gpu_check.exact_in_every_process({"math_settings": [exact]}, 2)  # a rank missing
    assert not gpu_check.exact_in_every_process({"math_settings": [exact, {**exact, "cudnn_allow_tf32": True}]}, 2)
    assert not gpu_check.exact_in_every_process({}, 2)  # a record from before the switch


def test_gpu_check_runs_the_equivalence_check_with_the_courses_switch_not_an_environment_variable(tmp_path):
    from tools import gpu_check

    [step] = [step for step in gpu_check.plan(2, str(tmp_path), (), tmp_path) if "equivalence" in step.name]
    assert step.env == {} and step.record == "equivalence" and "--json" in step.command
    [(what, _)] = step.checks
    assert what == "TF32 off, cuDNN deterministic and not benchmarking in all 2 processes"
