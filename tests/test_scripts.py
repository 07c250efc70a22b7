"""Every entry script runs end to end, as a user starts it, and writes a valid JSON record.

The course's steps run as `make run` starts them (scripts/tools/run_course.py: python for one process, torchrun
for two), once for the module: the tests of each step read that step's output and record, and the test of
`make run` reads its table.
"""
import subprocess

import pytest

from data_makers import write_image_folder, write_resnet18_weights
from gloo_exit_hook import COUNTS_THREADS_IN_PROC, exit_env, gloo_threads_at_exit
from helpers import PYTHON, REPO, SCRIPTS, assert_ok, read_json, run_python, script_env

# Three epochs (so three data orders, for the set_epoch checks below) of four steps each: past the three
# warm-up steps within the first epoch, so that every epoch has a steady rate, hence an MFU.
EPOCHS = 3
EACH_EPOCH = ("--max-steps", 4, "--batch-size", 32)
RECORD_KEYS = {"script", "world_size", "backend", "device", "hardware", "dataset", "model", "batch_size",
               "global_batch_size", "epochs", "per_epoch", "total_seconds", "final_test_accuracy", "final_test_loss"}
EPOCH_KEYS = {"epoch", "train_loss", "test_loss", "test_accuracy", "seconds", "samples_per_second", "mfu"}

# Each case: its step in `make run` (the label run_course.py prints and its record's name), the script, the
# world size and the backend.
CASES = {
    "step1_baseline": ("1 one process", "step1-step1_baseline", "step1_baseline.py", 1, None),
    "step2_allreduce per-parameter": ("2 all_reduce per-parameter", "step2-step2_allreduce", "step2_allreduce.py", 2,
                                      "gloo"),
    "step2_allreduce bucket": ("2 all_reduce bucket", "step3-step2_allreduce", "step2_allreduce.py", 2, "gloo"),
    "step3_data_parallel": ("3 DataParallel", "step4-step3_data_parallel", "step3_data_parallel.py", 1, None),
    "step4_ddp": ("4 DDP", "step5-step4_ddp", "step4_ddp.py", 2, "gloo"),
}


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """`make run`'s script, as the Makefile starts it, with short epochs: (the finished process, the folder of
    its records, the count of gloo threads each rank still had as it exited: tests/gloo_exit_hook.py). Every
    step's output and record come from this one run."""
    folder = tmp_path_factory.mktemp("course")
    env, exits = exit_env(tmp_path_factory.mktemp("course-exits"))
    done = run_python("tools/run_course.py", "--epochs", EPOCHS, "--results-dir", folder, "--", *EACH_EPOCH,
                      timeout=600, env=env)
    assert_ok(done)
    return done, folder, exits


@pytest.fixture(scope="module")
def case_run(course):
    """``case_run(case)`` is (what that step printed, stdout and stderr, its JSON record)."""
    done, folder, _ = course
    printed = {section.partition(" ===")[0]: section for section in done.stdout.split("\n=== step ")[1:]}

    def run(case):
        label, record, *_ = CASES[case]
        return printed[label], read_json(folder / f"{record}.json")

    return run


@pytest.mark.parametrize("case", CASES)
def test_script_runs_and_writes_its_record(case, case_run):
    _, _, script, world_size, backend = CASES[case]
    output, record = case_run(case)
    assert RECORD_KEYS <= record.keys()
    assert record["script"] == script.removesuffix(".py")
    assert (record["world_size"], record["backend"], record["device"]) == (world_size, backend, "cpu")
    assert record["global_batch_size"] == 32 * world_size
    assert [e["epoch"] for e in record["per_epoch"]] == [1, 2, 3]
    for epoch in record["per_epoch"]:
        assert EPOCH_KEYS <= epoch.keys()
        assert epoch["test_samples"] == 1000 and 0.0 <= epoch["test_accuracy"] <= 1.0
        assert epoch["seconds"] > 0 and epoch["samples_per_second"] > 0
        assert epoch["mfu"] > 0  # against this CPU's peak, measured at the start of the run
    assert record["peak"]["source"].startswith("measured") and record["peak"]["devices_per_process"] == 1
    # Rank 0 alone prints the epoch lines: one per epoch, not one per rank.
    assert output.count("epoch 1/3") == 1
    if world_size > 1:
        assert "pre-flight all_reduce ok: 2 rank(s) on 1 node(s)" in output


def test_run_course_prints_a_row_per_step(course):
    """`make run`: the whole course path runs and ends with one comparison table."""
    done, folder, _ = course
    table = done.stdout.split("\nstep ")[-1].splitlines()
    rows = table[2:]  # after the header and its rule
    assert [row[:28].strip() for row in rows] == ["1 one process", "2 all_reduce per-parameter", "2 all_reduce bucket",
                                                  "3 DataParallel", "4 DDP"]
    processes = [int(row.split()[-7]) for row in rows]
    assert processes == [1, 2, 2, 1, 2]  # no GPU here: 2 processes for the distributed steps
    assert all(row.endswith("%") for row in rows)
    assert sorted(path.name for path in folder.glob("*.json")) == [
        "step1-step1_baseline.json", "step2-step2_allreduce.json", "step3-step2_allreduce.json",
        "step4-step3_data_parallel.json", "step5-step4_ddp.json"]


def test_allreduce_and_ddp_train_identically(case_run):
    """Same seed, same shards, dropout on but seeded per rank alike: the same numbers. (step2_allreduce's
    default --mode is bucket.)"""
    (_, allreduce), (_, ddp) = case_run("step2_allreduce bucket"), case_run("step4_ddp")
    assert len(allreduce["per_epoch"]) == len(ddp["per_epoch"]) == 3
    for a, d in zip(allreduce["per_epoch"], ddp["per_epoch"]):
        assert a["train_loss"] == pytest.approx(d["train_loss"], abs=1e-5)
        assert a["test_accuracy"] == pytest.approx(d["test_accuracy"], abs=2e-3)


@COUNTS_THREADS_IN_PROC
def test_every_distributed_step_frees_its_group(course):
    """Each rank of the three torchrun steps (all_reduce per parameter, in a bucket, and DDP) exits with no gloo
    thread left: nothing kept its group alive to the end of the process (tests/test_teardown.py says why that
    matters). The steps in one process start no group and report nothing."""
    *_, exits = course
    assert gloo_threads_at_exit(exits) == [(0, 0)] * 3 + [(1, 0)] * 3


@pytest.mark.slow
def test_dataloader_route_runs_with_workers(results_dir, tmp_path):
    """Two epochs of two steps: the second epoch takes its batches from the same worker (persistent_workers),
    after --max-steps left the first epoch's iteration unfinished."""
    done = run_python("step1_baseline.py", "--epochs", 2, "--max-steps", 2, "--loader", "dataloader", "--workers", 1,
                      "--results-dir", results_dir, "--run-name", "run", "--checkpoint-dir", tmp_path / "checkpoints")
    assert_ok(done)
    assert read_json(results_dir / "run.json")["loader"] == "dataloader"


def epoch_orders(record):
    """The first indices rank 0 trained on in each epoch."""
    return [tuple(epoch["first_indices"]) for epoch in record["per_epoch"]]


SET_EPOCH = "sampler.set_epoch(epoch)"


def finetune_files(folder):
    """A two-class ImageFolder (16 training images) and a ResNet-18 weights file to start from."""
    write_resnet18_weights(folder / "weights.pt")
    return ("--data-dir", write_image_folder(folder / "digits"), "--weights", folder / "weights.pt", "--batch-size", 4)


# Every script that shuffles with a DistributedSampler, and what it needs to run one step an epoch.
SHUFFLING_SCRIPTS = {
    "step4_ddp.py": lambda folder: (),
    "step2_allreduce.py": lambda folder: (),
    "step2b_own_ddp.py": lambda folder: (),
    "step6_model_parallel.py": lambda folder: ("--dataset", "synthetic-cifar10", "--model", "resnet18",
                                                   "--batch-size", 8),
    "step6_finetune.py": finetune_files,
}


def run_for_orders(script_path, folder, env, extra):
    """Three epochs of one step in one process (plain python: the world of one that torchrun --nproc-per-node=1
    would make, without its launcher process). The order set_epoch changes is the shuffle all ranks share
    (DistributedSampler draws one permutation from seed + epoch, and each rank takes every world_size-th index of
    it), so one rank's order shows it, whatever the world size."""
    command = [PYTHON, str(script_path), "--epochs", "3", "--max-steps", "1", *map(str, extra),
               "--results-dir", str(folder / "r"), "--run-name", "orders", "--checkpoint-dir", str(folder / "c")]
    assert_ok(subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300))
    return epoch_orders(read_json(folder / "r" / "orders.json"))


def test_every_script_that_calls_set_epoch_is_checked_below():
    calling = sorted(path.name for path in SCRIPTS.glob("*.py") if SET_EPOCH in path.read_text())
    assert calling == sorted(SHUFFLING_SCRIPTS)


# Scripts whose three-epoch run above (CASES) gives the orders: no run of their own for the first check.
ORDERS_FROM_CASES = {"step4_ddp.py": "step4_ddp", "step2_allreduce.py": "step2_allreduce bucket"}


@pytest.mark.parametrize("script", [script if script in ORDERS_FROM_CASES
                                    else pytest.param(script, marks=pytest.mark.slow)
                                    for script in SHUFFLING_SCRIPTS])  # slow: the scripts that need runs of their own
def test_every_epoch_is_a_new_shuffle_and_a_missing_set_epoch_is_caught(script, tmp_path, case_run):
    extra = SHUFFLING_SCRIPTS[script](tmp_path)
    if script in ORDERS_FROM_CASES:
        orders = epoch_orders(case_run(ORDERS_FROM_CASES[script])[1])
    else:
        orders = run_for_orders(SCRIPTS / script, tmp_path / "with", script_env(), extra)
    assert len(orders) == 3 and len(set(orders)) == 3, orders  # three epochs, three different orders
    # The same script without its set_epoch line: every epoch repeats the first one's order.
    source = (SCRIPTS / script).read_text()
    assert source.count(SET_EPOCH) == 1
    broken = tmp_path / "broken" / script
    broken.parent.mkdir()
    broken.write_text("\n".join(line for line in source.splitlines() if SET_EPOCH not in line))
    orders = run_for_orders(broken, tmp_path / "without", script_env(PYTHONPATH=SCRIPTS), extra)
    assert len(orders) == 3 and len(set(orders)) == 1, orders
