"""The course's central claim: W processes with batch B train exactly like one process
with batch W x B, for the hand-written all_reduce (after backward, per parameter and in one
bucket; during backward, per parameter and in buckets: step2b_own_ddp.py) and for DDP.

Dropout is off in these runs (demos/verify_equivalence.py turns it off): its random masks
would differ between one process and two, whatever the seeds. TF32 and cuDNN's free choice of
algorithm are off too, in each process (kit/exactness.py): they change nothing on a CPU, but the
script must switch them off where it computes, as it would on GPUs.
"""
import pytest

from helpers import assert_ok, read_json, run_torchrun
from kit import exactness

AVERAGED = ["per-parameter", "bucket", "overlap", "overlap-bucket", "ddp"]


@pytest.fixture(scope="module", params=["adadelta", "sgd"])
def differences(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence") / "differences.json"
    done = run_torchrun("demos/verify_equivalence.py", "--steps", 5, "--batch-size", 32,
                        "--optimizer", request.param, "--json", out)
    assert_ok(done)
    return read_json(out)


def test_run_compares_two_ranks_of_32_with_one_process_of_64(differences):
    assert differences["world_size"] == 2 and differences["batch_size"] == 32 and differences["steps"] == 5


def test_each_rank_computed_with_the_courses_exact_math(differences):
    """Read back in each torchrun'd process, whose flags start at PyTorch's defaults (cuDNN may use TF32 and
    nondeterministic algorithms), so only the script's own exact_math() call makes them read so."""
    assert differences["math_settings"] == [exactness.EXACT] * differences["world_size"]


@pytest.mark.parametrize("method", AVERAGED)
def test_gradients_after_one_step_match_one_process(differences, method):
    assert differences["differences"][method]["gradient_step1"] < 1e-6


@pytest.mark.parametrize("method", AVERAGED)
def test_weights_match_one_process_after_one_and_after_five_steps(differences, method):
    per_step = differences["differences"][method]["weights_per_step"]
    assert len(per_step) == 5
    assert per_step[0] < 1e-6 and per_step[-1] < 1e-6


@pytest.mark.parametrize("method", AVERAGED)
def test_replicas_stay_identical_across_ranks(differences, method):
    assert differences["ranks_apart"][method] == 0.0


def test_the_comparison_can_fail_without_averaging(differences):
    """The control: skipping the average must be caught, or the checks above prove nothing."""
    control = differences["differences"]["no-averaging"]
    assert control["gradient_step1"] > 1e-3 and control["weights_per_step"][-1] > 1e-4
    assert differences["ranks_apart"]["no-averaging"] > 1e-4
