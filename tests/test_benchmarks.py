"""The benchmark harness, its targets and tables, the all_reduce micro-benchmark, the figures, and
`make gpu-check` on a machine without a GPU.

No test here judges a speed: the numbers come from whatever this machine does right now, and only
their consistency is checked (a ratio is the ratio of the numbers it is made of, busbw follows its
formula, a record says where it ran). The targets live in the benchmark records.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gloo_exit_hook import COUNTS_THREADS_IN_PROC, exit_env, gloo_threads_at_exit
from helpers import REPO, assert_ok, script_env

sys.path.insert(0, str(REPO))  # for the package benchmarks/, imported as the commands import it
from benchmarks import allreduce_bandwidth, common, harness, report  # noqa: E402


def run_benchmark(script, *args, timeout=600, env=None):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *map(str, args)], cwd=REPO,
                          env=env or script_env(), capture_output=True, text=True, timeout=timeout)


def only_record(folder, kind):
    paths = list(Path(folder).glob(f"{kind}-*.json"))
    assert len(paths) == 1, paths
    return json.loads(paths[0].read_text())


# ---- the plan ---------------------------------------------------------------------------------

def layouts(runs, role="scaling"):
    return {(r.method.name, r.layout.processes, r.layout.threads, r.layout.batch_size) for r in runs if r.role == role}


def test_cpu_plan_holds_processes_times_threads_to_the_cores():
    machine = harness.Machine(gpus=0, cores=2)
    net = harness.MODELS[0]
    runs = harness.plan(harness.METHODS, [net], machine)
    assert layouts(runs) >= {("one process", 1, 1, 64), ("one process", 1, 2, 64), ("DDP", 2, 1, 64),
                             ("all_reduce per-parameter", 2, 1, 64), ("all_reduce bucket", 2, 1, 64)}
    assert all(r.layout.processes * r.layout.threads <= 2 for r in runs)
    assert layouts(runs, "same global batch") == {("one process", 1, 2, 128)}
    assert layouts(runs, "compute only") == {("one process", 2, 1, 64)}
    assert "DataParallel" in machine.skipped and not any(r.method.name == "DataParallel" for r in runs)


def test_plan_on_six_cores_and_on_four_gpus():
    assert harness.process_counts(harness.Machine(gpus=0, cores=6)) == [2, 3, 6]
    machine = harness.Machine(gpus=4, cores=16)
    runs = harness.plan(harness.METHODS, [harness.MODELS[0]], machine)
    assert {r.layout.processes for r in runs if r.method.name == "DDP"} == {1, 2, 4}
    assert any(r.method.name == "DataParallel" for r in runs) and not machine.skipped
    assert all(r.layout.threads is None for r in runs) and not layouts(runs, "compute only")


def test_compute_only_runs_take_the_steps_of_one_distributed_process():
    net = harness.MODELS[0]
    run = harness.Run(harness.METHODS[0], net, harness.Layout(2, 1, 64), "compute only")
    assert harness.steps_per_process(run, net) == 32  # 4,000 samples / 2 processes / 64 per batch
    command = harness.command(run, "/tmp/x", "name", epochs=2)
    assert command[-2:] == ["--max-steps", "32"] and "--threads" in command


def test_not_accepted_is_told_from_a_failure():
    argparse_error = "usage: step2_allreduce.py [-h]\nstep2_allreduce.py: error: argument --mode: invalid choice: 'x'"
    assert harness.why_not_accepted(argparse_error).startswith("step2_allreduce.py: error: argument --mode")
    assert harness.why_not_accepted("error: unknown --model 'vit'; choose one of: net") is not None
    assert harness.why_not_accepted("Traceback (most recent call last):\nRuntimeError: boom") is None


@pytest.mark.slow
def test_an_entry_the_scripts_do_not_accept_is_skipped_and_said(tmp_path):
    """Real runs of the scripts with a mode and a data set they do not know: skipped, with their reason."""
    machine = harness.Machine(gpus=0, cores=2)
    net = harness.MODELS[0]
    unknown_mode = harness.Method("no such mode", "step2_allreduce.py", True, ("--mode", "no-such-mode"))
    run = harness.Run(unknown_mode, net, harness.Layout(2, 1, 64), "scaling")
    assert harness.run_once(run, tmp_path, "a", 1, machine) is None
    assert "invalid choice: 'no-such-mode'" in machine.skipped["no such mode (net)"]
    no_data = harness.Model("nodata", "a data set the scripts lack", ("--dataset", "no-such-data"), 64, 1, 0.5, 100)
    run = harness.Run(harness.METHODS[0], no_data, harness.Layout(1, 1, 64), "scaling")
    assert harness.run_once(run, tmp_path, "b", 1, machine) is None
    assert "no-such-data" in machine.skipped["model nodata"]
    ddp = next(m for m in harness.METHODS if m.name == "DDP")
    assert harness.is_skipped(harness.Run(ddp, no_data, harness.Layout(2, 1, 64), "scaling"), machine)


@pytest.mark.slow
def test_a_real_failure_is_not_taken_for_a_skip(tmp_path):
    machine = harness.Machine(gpus=0, cores=2)
    broken = harness.Method("broken", "step1_baseline.py", False, ("--timeout", "0"))  # argparse: must be >= 1
    run = harness.Run(broken, harness.MODELS[0], harness.Layout(1, 1, 64), "scaling")
    with pytest.raises(RuntimeError, match="failed"):
        harness.run_once(run, tmp_path, "c", 1, machine)


@pytest.mark.slow  # runs every course step end to end: make test runs it, make test-fast leaves it out
def test_harness_runs_the_course_scripts_and_writes_one_record(tmp_path):
    """A subset of the methods, as the harness's help invites: the bucket after backward is left out, so one target
    has one of its two steps and is reported as not measured."""
    # One epoch of four steps: past the scripts' three warm-up steps, so that every run has a steady rate.
    done = run_benchmark("harness.py", "--methods", "one process", "DDP", "all_reduce overlap-bucket", "--models",
                         "net", "--repeats", "1", "--epochs", "1", "--max-steps", "4", "--records", tmp_path)
    assert_ok(done)
    record = only_record(tmp_path, "harness")
    assert done.stdout.index("record written to") < done.stdout.index("**Targets**")
    targets = {t["name"].split(",")[0]: t for t in record["targets"]}
    assert targets["overlap-bucket step / DDP step"]["measured"] is not None
    unmeasured = targets["after-backward bucket step / overlap-bucket step"]
    assert unmeasured["measured"] is None and unmeasured["met"] is None
    assert "not measured: no run of all_reduce bucket (step2_allreduce.py --mode bucket)" in done.stdout
    assert record["machine"] == {"gpus": 0, "cores": common.usable_cores()}
    rows = {(r["method"], r["role"], r["processes"], r["threads"]): r for r in record["rows"]}
    ddp, single = rows[("DDP", "scaling", 2, 1)], rows[("one process", "same global batch", 1, 2)]
    assert ddp["global_batch_size"] == single["global_batch_size"] == 128
    assert ddp["step_seconds"] == pytest.approx(128 / ddp["samples_per_second"])  # a batch of 64 on each of 2
    assert ddp["seconds_per_epoch"] == pytest.approx(4 * ddp["step_seconds"])  # --max-steps 4
    compute_only = rows[("one process", "compute only", 2, 1)]
    assert compute_only["global_batch_size"] == 128  # two independent processes of 64
    first = report.ddp_against_threads(record["rows"], 0, 2)
    assert first["measured"] == pytest.approx(ddp["samples_per_second"] / single["samples_per_second"])
    assert "| DDP | 2 x 1 thread | 128 |" in done.stdout and "**Targets**" in done.stdout


# ---- targets and tables -----------------------------------------------------------------------

def synthetic_record(steps, mfu=0.35):
    """A harness record with the given step seconds per method (2 processes x 1 thread)."""
    rows = [dict(model="net", method="one process", role="same global batch", processes=1, threads=2, batch_size=128,
                 samples_per_second=1000.0, step_seconds=0.128, mfu=None),
            dict(model="net", method="one process", role="scaling", processes=1, threads=2, batch_size=64,
                 samples_per_second=950.0, step_seconds=0.067, mfu=mfu)]
    for method, seconds in steps.items():
        rows.append(dict(model="net", method=method, role="scaling", processes=2, threads=1, batch_size=64,
                         samples_per_second=128 / seconds, step_seconds=seconds, mfu=None))
    return {"rows": rows, "machine": {"gpus": 0, "cores": 2}}


def targets_by_name(record):
    return {t["name"].split(",")[0]: t for t in report.check_targets(record)}


def test_targets_from_a_record_where_all_are_met():
    record = synthetic_record({"all_reduce per-parameter": 0.2, "all_reduce bucket": 0.14,
                               "all_reduce overlap-bucket": 0.13, "DDP": 0.128}, mfu=0.71)
    targets = report.check_targets(record)
    assert [t["met"] for t in targets] == [True, True, True, True, None, True]
    assert targets[0]["measured"] == pytest.approx(1.0)  # 128 / 0.128 samples/s against 1,000
    assert targets[1]["measured"] == pytest.approx(0.13 / 0.128)
    assert "no GPU" in targets[4]["note"]


def test_targets_that_are_missed_or_cannot_be_measured_say_so():
    record = synthetic_record({"all_reduce per-parameter": 0.1, "all_reduce bucket": 0.14, "DDP": 0.2}, mfu=0.3)
    targets = report.check_targets(record)
    assert targets[0]["met"] is False  # 640 against 1,000 samples/s
    assert targets[1]["met"] is None and "overlap-bucket" in targets[1]["note"]
    assert targets[3]["met"] is False  # per parameter was not the slowest here
    assert targets[5]["met"] is False and targets[5]["measured"] == 0.3
    table = report.targets_table(targets)
    assert "| **no** |" in table
    assert "not measured: no run of all_reduce overlap-bucket (step2b_own_ddp.py --mode overlap-bucket)" in table


def test_a_target_with_one_of_its_steps_unmeasured_is_not_measured_and_the_others_are_judged():
    """The overlapped bucket and DDP without the bucket after backward: a subset of the methods the harness allows."""
    record = synthetic_record({"all_reduce overlap-bucket": 0.13, "DDP": 0.128})
    targets = targets_by_name(record)
    assert targets["overlap-bucket step / DDP step"]["measured"] == pytest.approx(0.13 / 0.128)
    unmeasured = targets["after-backward bucket step / overlap-bucket step"]
    assert (unmeasured["measured"], unmeasured["met"]) == (None, None)
    assert unmeasured["note"] == "no run of all_reduce bucket (step2_allreduce.py --mode bucket)"
    per_parameter = targets["per-parameter step / slowest other method's step"]
    assert per_parameter["note"] == "no run of all_reduce per-parameter (step2_allreduce.py --mode per-parameter)"
    with_no_distributed_run = targets_by_name(synthetic_record({}))
    assert "DDP N processes x 1 thread / 1 process x N threads" in with_no_distributed_run


def test_the_runs_the_targets_compare_are_named_as_the_harness_runs_them():
    methods = {method.name: " ".join((method.script, *method.args)) for method in harness.METHODS}
    assert report.COMPARED_RUNS == {name: methods[name] for name in report.COMPARED_RUNS}


def test_the_harness_writes_its_record_before_it_judges_the_targets(tmp_path, monkeypatch):
    """Judging the targets comes after minutes of measuring: a mistake there must not lose the measurements."""
    record = {**synthetic_record({"DDP": 0.128}), "benchmark": "harness"}
    monkeypatch.setattr(harness, "measure_everything", lambda args: dict(record))

    def judging_fails(measured):
        raise TypeError("a mistake in judging a target")

    monkeypatch.setattr(report, "check_targets", judging_fails)
    with pytest.raises(TypeError, match="judging"):
        harness.main(["--records", str(tmp_path)])
    assert only_record(tmp_path, "harness")["rows"] == record["rows"]


def test_on_one_gpu_the_communication_targets_are_not_judged():
    """With one GPU every distributed method is a world of one: its steps cannot show overlap or bucketing."""
    record = synthetic_record({"all_reduce per-parameter": 0.1, "all_reduce bucket": 0.14,
                               "all_reduce overlap-bucket": 0.2, "DDP": 0.15})
    for row in record["rows"]:
        row["processes"], row["threads"] = 1, None
    record["machine"] = {"gpus": 1, "cores": 16}
    targets = targets_by_name(record)
    for name in ("overlap-bucket step / DDP step", "after-backward bucket step / overlap-bucket step",
                 "per-parameter step / slowest other method's step"):
        assert targets[name]["met"] is None and "needs 2 or more GPUs" in targets[name]["note"], name
        assert targets[name]["measured"] is not None, name  # shown, as measured, but not judged
    record["machine"]["gpus"] = 0  # the same steps from 2 processes are judged (and here all missed)
    for row in record["rows"]:
        if row["method"] != "one process":
            row["processes"] = 2
    assert targets_by_name(record)["overlap-bucket step / DDP step"]["met"] is False

def test_targets_measured_on_a_busy_machine_are_shown_but_not_judged():
    record = synthetic_record({"all_reduce per-parameter": 0.2, "all_reduce bucket": 0.14, "DDP": 0.128}, mfu=0.71)
    record["load_average"] = {"max": 2.5, "samples": [1.0, 2.5]}  # more runnable work than the 2 cores
    targets = report.check_targets(record)
    assert targets[0]["measured"] == pytest.approx(1.0) and targets[0]["met"] is None
    assert targets[0]["note"] == "not judged: load average up to 2.5 on 2 cores"
    assert "overlap-bucket" in targets[1]["note"]  # not measured stays not measured
    record["load_average"]["max"] = 1.9
    assert report.check_targets(record)[0]["met"] is True


def test_step_split_subtracts_the_step_without_communication():
    rows = [dict(model="net", method="DDP", role="scaling", processes=2, threads=1, batch_size=64, step_seconds=0.080),
            dict(model="net", method="one process", role="compute only", processes=2, threads=1, batch_size=64,
                 step_seconds=0.070)]
    assert report.step_split(rows, rows[0], gpus=0) == "80 = 70 + 10"
    assert report.step_split(rows[:1], rows[0], gpus=0) == "80"  # no reference measured: no split shown
    rows[1]["step_seconds"] = 0.090  # the step without communication was slower: nothing to subtract
    assert report.step_split(rows, rows[0], gpus=0) == "80 (no split: the step without communication took 90)"


def test_time_to_accuracy_column_only_where_the_model_has_a_target():
    record = synthetic_record({"DDP": 0.128})
    for row in record["rows"]:
        row.update(global_batch_size=row["processes"] * row["batch_size"], seconds_per_epoch=4.0,
                   time_to_target=3.5 if row["role"] == "scaling" else None)
    record["models"] = {"net": {"target_accuracy": 0.94}}
    header, _, *body = report.scaling_table(record, "net").splitlines()
    assert "| time to 94% |" in header and body[-1].endswith("| 3.5 s | n/a |")  # no 1 x 1 run here
    record["models"]["net"]["target_accuracy"] = None  # made-up data: speed only
    header, rule, *body = report.scaling_table(record, "net").splitlines()
    assert "time to" not in header and "3.5 s" not in body[-1]
    assert header.count("|") == rule.count("|") == body[-1].count("|")
    assert harness.time_to_target({"per_epoch": [{"seconds": 2.0, "test_accuracy": 0.9}]}, None) is None


def test_cpu_profile_table_shares_and_rates():
    record = {"hardware": {"cpu": "a CPU", "cpu_cores": 2, "torch": "2.x", "gpus": []}, "threads": 2,
              "batch_size": 64, "steps": 30, "peak_flops": 200e9, "load_average": [0.1, 0.2],
              "seconds_per_step": {"convolution": 0.04, "matmul": 0.01, "elementwise and pooling": 0.03,
                                   "optimizer": 0.02},
              "flops_per_step": {"convolution": 4e9, "matmul": 0.5e9}}
    table = report.render_cpu_profile(record)
    assert "| convolutions (forward and backward) | 40.0 | 40% | 100 | 50% |" in table
    assert "| linear layers' matrix products | 10.0 | 10% | 50 | 25% |" in table
    assert "| the whole step | 100.0 | 100% | 45 | 22% |" in table


def test_the_performance_page_quotes_exactly_the_committed_records():
    """Every block of docs/performance.md names a committed record and shows what that record renders to."""
    blocks = list(report.page_blocks(report.PAGE.read_text()))
    assert {Path(path).name.split("-")[0] for path, _, _ in blocks} >= {"harness", "allreduce", "time_to_accuracy",
                                                                         "cpu_step_profile"}
    for path, body, rendered in blocks:
        assert path.startswith("benchmarks/results/"), path
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=REPO, capture_output=True)
        assert tracked.returncode == 0, f"{path} is quoted by docs/performance.md but not committed"
        assert body == rendered, \
            f"the block of {path} differs from its record: python benchmarks/report.py --update-page"
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/harness-new.json"], cwd=REPO)
    assert ignored.returncode == 1, "git ignores new records in benchmarks/results/: they could not be committed"


def test_every_committed_record_is_quoted_or_named_on_the_performance_page():
    """A record nobody reads judges nothing: each file in benchmarks/results/ is on the page, as a block or by name."""
    page = report.PAGE.read_text()
    records = REPO / "benchmarks" / "results"
    for record in sorted(records.rglob("*.json")):  # the GPU records in gpu/ too
        name = record.relative_to(records).as_posix()
        assert f"benchmarks/results/{name}" in page, f"{name} is committed but docs/performance.md never names it"


def test_a_changed_record_no_longer_matches_its_block():
    """The check above can fail: one number changed in a record changes what its block must say."""
    text = report.PAGE.read_text()
    path, body, rendered = next(report.page_blocks(text))
    record = json.loads((REPO / path).read_text())
    record["load_average"] = {**record["load_average"], "max": record["load_average"]["max"] + 1}
    assert report.render(record) + "\n" != body


# ---- all_reduce bandwidth ---------------------------------------------------------------------

def test_bus_bandwidth_follows_nccl_tests():
    assert allreduce_bandwidth.bus_bandwidth(10.0, 2) == 10.0  # 2 ranks: 2(n-1)/n = 1
    assert allreduce_bandwidth.bus_bandwidth(10.0, 4) == 15.0
    assert allreduce_bandwidth.bus_bandwidth(10.0, 8) == 17.5
    assert allreduce_bandwidth.bus_bandwidth(10.0, 1) == 0.0  # one rank: nothing crosses a link


def test_sizes_and_repeats():
    assert common.parse_size("1K") == 1024 and common.parse_size("256M") == 256 * 2**20
    assert common.format_size(256 * 2**20) == "256 MiB" and common.format_size(1000) == "1000 B"
    sizes = allreduce_bandwidth.message_sizes(common.parse_size("1K"), common.parse_size("256M"), 4)
    assert sizes[0] == 1024 and sizes[-1] == 256 * 2**20 and len(sizes) == 10
    assert allreduce_bandwidth.iterations_for(2**30, 2**30) == 5
    assert allreduce_bandwidth.iterations_for(1024, 2**30) == 200


@pytest.mark.slow
def test_allreduce_benchmark_runs_on_gloo_and_compares_the_gradient_bucket(tmp_path):
    done = run_benchmark("allreduce_bandwidth.py", "--max-bytes", "64K", "--budget", "256K", "--records", tmp_path)
    assert_ok(done)
    record = only_record(tmp_path, "allreduce")
    assert (record["world_size"], record["backend"]) == (2, "gloo")
    assert [row["bytes"] for row in record["sizes"]] == [1024, 4096, 16384, 65536]
    for row in record["sizes"]:
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # n = 2
    gradients = record["gradients"]
    assert (gradients["tensors"], gradients["bytes"]) == (8, 1_199_882 * 4)  # the Net: 8 tensors, 4.6 MiB
    assert "the course's gradient all_reduce (net, 8 tensors, 4.6 MiB)" in done.stdout


# ---- time to accuracy, figures ------------------------------------------------------------------

@pytest.mark.slow
def test_time_to_accuracy_writes_a_record_with_medians(tmp_path):
    done = run_benchmark("time_to_accuracy.py", "--repeats", 1, "--max-epochs", 1, "--target", 0.5,
                         "--records", tmp_path)
    assert_ok(done)
    record = only_record(tmp_path, "time_to_accuracy")
    for name, runs in record["runs"].items():
        assert record["summary"][name]["median_seconds"] == runs[0]["seconds"]
    assert "| the pytorch/examples MNIST recipe |" in done.stdout and "| the course's default |" in done.stdout


@pytest.mark.slow
def test_figures_from_the_committed_records(tmp_path):
    done = run_benchmark("plots.py", "--records", REPO / "benchmarks" / "results", "--figs", tmp_path)
    assert_ok(done)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "allreduce_bandwidth.png", "benchmark_scaling.png", "benchmark_step_split.png"]


# ---- make gpu-check -----------------------------------------------------------------------------

def gpu_check_plan(gpus, capsys, tmp_path, monkeypatch):
    """What `gpu_check.py --dry-run --gpus N` prints, from its main() in this process: the plan alone, so no
    process of its own is needed (the test below runs the real command)."""
    from tools import gpu_check

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its results folder, named in the commands shown
    assert gpu_check.main(["--dry-run", "--gpus", str(gpus)]) is None
    return capsys.readouterr().out


def test_gpu_check_plans_every_step_for_four_gpus(capsys, tmp_path, monkeypatch):
    out = gpu_check_plan(4, capsys, tmp_path, monkeypatch)
    assert out.count("--nproc-per-node=4") == 4  # all_reduce x 2, DDP, equivalence
    assert "3 DataParallel over 4 GPU(s)" in out and "--pin-memory" in out and "--device cuda:0" in out
    assert "kit/exactness.py" in out and "allreduce_bandwidth.py" in out and "harness.py" in out


def test_gpu_check_on_one_gpu_runs_each_step_with_one_process(capsys, tmp_path, monkeypatch):
    out = gpu_check_plan(1, capsys, tmp_path, monkeypatch)
    assert out.count("--nproc-per-node=1") == 3 and "verify_equivalence" not in out


def test_gpu_check_notes_first_a_torch_other_than_the_pinned_one(capsys, tmp_path, monkeypatch):
    """A GPU node's own torch may be another release than the course pins; a step that fails there for want of
    an API is then not the GPU's fault, and the run says so before its first step."""
    from tools import gpu_check

    assert gpu_check.version_note("2.14.1+cu130", "2.14.1") is None
    monkeypatch.setattr(gpu_check, "pinned_torch", lambda: "9.9.9")
    out = gpu_check_plan(1, capsys, tmp_path, monkeypatch)
    assert out.startswith(f"note: this Python has torch {torch.__version__}, the course pins 9.9.9 "
                          "(requirements.txt)"), out


class Walltime(Exception):
    """A run cut short between two steps."""


def test_a_gpu_check_cut_short_keeps_the_record_of_the_steps_it_made(tmp_path, monkeypatch):
    """A run stopped between two steps (a walltime, a lease that ends) has on disk, already, a record of the steps
    before it, marked unfinished and not judged."""
    from tools import gpu_check

    steps = [gpu_check.Step(name, [sys.executable, "-c", "pass"]) for name in ("first", "second")]
    monkeypatch.setattr(gpu_check, "plan", lambda *args: steps)
    real_run_step, on_disk = gpu_check.run_step, []

    def cut_before_the_second(step, results):
        if step.name == "second":
            on_disk.append(only_record(tmp_path, "gpu-check"))  # what a killed process would leave
            raise Walltime
        return real_run_step(step, results)

    monkeypatch.setattr(gpu_check, "run_step", cut_before_the_second)
    with pytest.raises(Walltime):
        gpu_check.main(["--gpus", "0", "--records", str(tmp_path)])
    [record] = on_disk
    assert [step["step"] for step in record["steps"]] == ["first"] and record["steps"][0]["returncode"] == 0
    assert record["finished"] is False and record["passed"] is None


BLOCK_EXTRAS = '''
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"pytest", "nbval", "jupyter", "jupyter_core", "IPython", "nbformat", "nbconvert"}:
            raise ImportError(f"{name} is not in a plain python3")
sys.meta_path.insert(0, Blocker())
'''


@pytest.mark.slow  # runs every course step end to end: make test runs it, make test-fast leaves it out
def test_make_gpu_check_without_a_gpu_runs_the_cpu_fallback_with_plain_packages(tmp_path):
    """`make gpu-check` as a user runs it, with anything beyond torch, torchvision, tqdm and matplotlib
    made unimportable: the fallback runs every step on the CPU, checks each record and says that the
    GPU path was not checked."""
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCK_EXTRAS)
    env = script_env()
    env["PYTHONPATH"] = str(tmp_path / "blocker")
    done = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}",
                           f"RECORDS={tmp_path / 'records'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert_ok(done)
    assert "the GPU path is NOT checked" in done.stdout and "GPU path NOT checked" in done.stdout
    record = only_record(tmp_path / "records", "gpu-check")
    assert record["passed"] and record["finished"] and record["gpus"] == 0
    names = [step["step"] for step in record["steps"]]
    assert len(names) == 7 and names[0].startswith("1 one process") and names[-1].startswith("4 the checkpoint")
    ddp = next(step for step in record["steps"] if step["step"].startswith("4 DDP"))
    assert ddp["record"]["backend"] == "gloo" and ddp["record"]["world_size"] == 2 and all(ddp["checks"].values())


def test_gpu_check_with_a_python_that_lacks_the_packages_says_what_to_install():
    """A python3 without torch (here: the same interpreter without its site-packages, -S) gets one line."""
    done = subprocess.run([sys.executable, "-S", str(REPO / "scripts" / "tools" / "gpu_check.py"), "--dry-run"],
                          cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "has no torch, torchvision, tqdm, matplotlib" in done.stderr
    assert "make gpu-check PY=" in done.stderr


@pytest.fixture(scope="module")
def allreduce_with_nproc(tmp_path_factory):
    """The all_reduce benchmark started as a user starts it, with --nproc 2 (it starts torchrun itself): its
    record, and the count of gloo threads each rank still had as it exited (tests/gloo_exit_hook.py)."""
    folder = tmp_path_factory.mktemp("allreduce-nproc")
    env, exits = exit_env(folder)
    done = run_benchmark("allreduce_bandwidth.py", "--nproc", 2, "--device", "cpu", "--max-bytes", "4K",
                         "--budget", "16K", "--records", folder / "records", env=env)
    assert_ok(done)
    return only_record(folder / "records", "allreduce"), exits


@pytest.mark.slow
def test_allreduce_benchmark_with_nproc_and_device_cpu(allreduce_with_nproc):
    arguments = ["--nproc", "2", "--max-bytes", "4K", "--nproc=3"]
    assert allreduce_bandwidth.without_nproc(arguments) == ["--max-bytes", "4K"]
    record, _ = allreduce_with_nproc
    assert (record["world_size"], record["backend"], record["device"]) == (2, "gloo", "cpu")


@pytest.mark.slow
@COUNTS_THREADS_IN_PROC
def test_allreduce_benchmark_frees_its_group(allreduce_with_nproc):
    """Each rank exits with no gloo thread left (tests/test_teardown.py says why that matters)."""
    _, exits = allreduce_with_nproc
    assert gloo_threads_at_exit(exits) == [(0, 0), (1, 0)]


@pytest.mark.slow
def test_gpu_check_runs_a_notebook_on_a_node_where_the_course_kernel_is_not_registered(tmp_path):
    """The notebooks name the kernel "ddp-course"; a GPU node need not have it (no `make kernel` there)."""
    from tools import gpu_check

    notebook = tmp_path / "tiny.ipynb"
    notebook.write_text(json.dumps({
        "nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {
            "name": "ddp-course", "display_name": "Python (ddp-course)", "language": "python"}},
        "cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": "print(6 * 7)"}]}))
    no_user_kernels = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path / "jupyter"))
    done = subprocess.run([*gpu_check.EXECUTE_NOTEBOOK, "--output-dir", tmp_path / "out", notebook],
                          env=no_user_kernels, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    executed = json.loads((tmp_path / "out" / "tiny.ipynb").read_text())
    assert "".join(executed["cells"][0]["outputs"][0]["text"]) == "42\n"
