"""The learning rate the scripts use per world size under --lr-scaling linear (the linear scaling rule of
Goyal et al. 2017, with its gradual warm-up), read from the optimizer in real runs of 1 process (python: a
world of one, as torchrun --nproc-per-node=1 would make it) and 2 (torchrun), and what --lr-scaling none and
--accumulate do to it."""
import pytest

from helpers import REPO, SCRIPTS, SHORT_TEST_SPLIT, assert_ok, read_json, run_python, run_torchrun, script_env
from machinery import cli

pytestmark = pytest.mark.slow  # real runs of 1 and 2 processes, several epochs each

BASE = 2e-3  # Adam's default rate, for --batch-size 64 (scripts/lesson/loop.py)
GAMMA = 0.7  # --gamma, once an epoch
STEPS = 3  # --max-steps: optimizer steps per epoch
RULE = ("--lr-scaling", "linear", "--warmup-steps", "2")

# (processes, extra flags) -> the rate of each of the 6 optimizer steps (2 epochs of 3), as the rule
# documented in scripts/kit/learning_rate.py gives it for global batch / --batch-size = k:
# k x BASE, reached from BASE in 2 equal steps, then x GAMMA from the second epoch on.
RUNS = {
    "1 process": (1, RULE, [BASE] * 3 + [BASE * GAMMA] * 3),  # k = 1: nothing to scale, nothing to warm up
    "1 process, --accumulate 2": (1, (*RULE, "--accumulate", "2"),  # k = 2: the global batch of 2 processes
                                  [BASE, 1.5 * BASE, 2 * BASE] + [2 * BASE * GAMMA] * 3),
    "2 processes": (2, RULE, [BASE, 1.5 * BASE, 2 * BASE] + [2 * BASE * GAMMA] * 3),  # k = 2
    "2 processes, --lr-scaling none": (2, (), [BASE] * 3 + [BASE * GAMMA] * 3),  # the rate as given
}


@pytest.fixture(scope="module")
def rates(tmp_path_factory):
    """{run: (the rates each rank's optimizer used, the run's output)}."""
    found = {}
    for name, (processes, flags, _) in RUNS.items():
        folder = tmp_path_factory.mktemp(name.replace(" ", "-").replace(",", ""))
        command = (REPO / "tests" / "learning_rate_run.py", "--device", "cpu", "--epochs", 2, "--max-steps", STEPS,
                   *flags, *SHORT_TEST_SPLIT, "--checkpoint-dir", folder / "checkpoints",
                   "--results-dir", folder / "results")
        env = script_env(PYTHONPATH=SCRIPTS, LEARNING_RATE_LOG=folder / "rates")
        # The rule reads the world size alone: one process needs no torchrun (a launcher process less).
        done = run_python(*command, env=env) if processes == 1 else run_torchrun(*command, nproc=processes, env=env)
        assert_ok(done)
        found[name] = ([read_json(folder / "rates" / f"rank{rank}.json") for rank in range(processes)], done.stdout)
    return found


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_steps_with_the_rate_the_rule_gives_its_world_size(rates, name):
    per_rank, _ = rates[name]
    expected = RUNS[name][2]
    for rank, used in enumerate(per_rank):
        assert used == pytest.approx(expected, rel=1e-9), f"{name}, rank {rank}"


def test_rank_0_says_which_rate_the_rule_gave(rates):
    _, output = rates["2 processes"]
    assert ("learning rate 0.004 = 2 x 0.002 (--lr-scaling linear: global batch 128 / --batch-size 64), "
            "reached after 2 warm-up steps from 0.002") in output
    assert "learning rate" not in rates["2 processes, --lr-scaling none"][1]


def test_a_warm_up_without_a_rule_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.parse_args(["--warmup-steps", "5"])
    assert stopped.value.code == 2
    assert "--warmup-steps ramps the learning rate up to the rate --lr-scaling gives" in capsys.readouterr().err
