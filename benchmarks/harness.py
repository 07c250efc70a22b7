"""The benchmark harness: every method on every model, over the world sizes this machine allows.

    python benchmarks/harness.py                      # what `make benchmark` runs
    python benchmarks/harness.py --repeats 1 --models net --methods "one process" DDP

For each method (one process; all_reduce by hand per parameter, in one bucket, and overlapped;
DataParallel where there are GPUs; DDP; DDP with no_sync accumulation) and each model, it runs the
course's own scripts as a user would (python or torchrun) and reads the JSON record each run writes:
throughput, seconds per epoch, time to a target accuracy, MFU, and the time of a step split into
compute and communication. The tables METHODS and MODELS below are the whole plan: a new method or
model is one entry. An entry the scripts do not accept yet (an unknown --mode, flag, model or data
set) is skipped, and the output says so, so the harness keeps working while the course grows.

World sizes: every GPU count up to the GPUs present; on a CPU, processes x threads held to the
cores (2 cores: 1 process x 2 threads, 2 processes x 1 thread, and 1 x 1 as the per-core unit for
scaling efficiency). Runs alternate within each repeat, so a busy moment hits every variant alike;
the tables show medians over repeats. Steady state: the scripts leave each process's first steps
(memory allocation, kernel choice, the first collectives) out of the throughput they record, and
throughput, s/epoch, step time and MFU here are those steady numbers; time to accuracy counts
everything but evaluation.

Compute against communication: the same step with no communication is timed by running, at the
same moment, as many independent one-process runs (same per-process batch, threads and steps) as
the distributed run has processes; the rest of the distributed step is communication and its
overhead (exposed, i.e. not hidden behind backward).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repository root, not this folder, goes on sys.path (__init__.py)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import torch  # noqa: E402

from benchmarks import common, report  # noqa: E402


@dataclass(frozen=True)
class Method:
    name: str
    script: str
    distributed: bool  # started by torchrun, one process per device
    args: tuple = ()
    needs_gpu: str = ""  # why it is skipped without a GPU ("" = runs anywhere)


@dataclass(frozen=True)
class Model:
    name: str
    description: str
    args: tuple
    batch_size: int  # per process
    epochs: int
    target_accuracy: float | None  # None: made-up data, where only speed means anything
    train_size: int  # training samples per epoch
    max_steps: int | None = None  # per epoch, for models too slow for whole epochs on a CPU


METHODS = [
    Method("one process", "step1_baseline.py", False),
    Method("all_reduce per-parameter", "step2_allreduce.py", True, ("--mode", "per-parameter")),
    Method("all_reduce bucket", "step2_allreduce.py", True, ("--mode", "bucket")),
    Method("all_reduce overlap", "step2b_own_ddp.py", True, ("--mode", "overlap")),
    Method("all_reduce overlap-bucket", "step2b_own_ddp.py", True, ("--mode", "overlap-bucket")),
    Method("DataParallel", "step3_data_parallel.py", False,
           needs_gpu="DataParallel needs GPUs: on a CPU it calls the model in one process, as step 1 does"),
    Method("DDP", "step4_ddp.py", True),
    Method("DDP no_sync, accumulate 4", "step4_ddp.py", True, ("--accumulate", "4")),
    Method("one process, pytorch/examples recipe", "step1_baseline.py", False,
           ("--loader", "dataloader", "--workers", "1", "--pin-memory", "--optimizer", "adadelta", "--lr", "1.0"),
           needs_gpu="the pytorch/examples MNIST recipe is compared on a GPU "
                     "(on a CPU: benchmarks/time_to_accuracy.py)"),
]

MODELS = [
    Model("net", "the MNIST Net, bundled MNIST subset (4,000 training images)",
          ("--dataset", "mnist5k", "--model", "net"), batch_size=64, epochs=3, target_accuracy=0.94, train_size=4000),
    # CIFAR-10's shape, made up in memory: offline, and what is measured is speed, not accuracy.
    Model("resnet18", "ResNet-18, CIFAR-shaped data (synthetic-cifar10, 10,000 images made up in memory)",
          ("--dataset", "synthetic-cifar10", "--model", "resnet18"),
          batch_size=32, epochs=2, target_accuracy=None, train_size=10000, max_steps=20),
]

# What a script prints when it does not accept an entry yet (argparse, or the course's own check).
NOT_ACCEPTED = ("invalid choice:", "unrecognized arguments:", "error: unknown --", "not found under")


@dataclass(frozen=True)
class Layout:
    processes: int
    threads: int | None  # CPU threads per process (None on GPUs: the scripts' default)
    batch_size: int  # per process


@dataclass(frozen=True)
class Run:
    method: Method
    model: Model
    layout: Layout
    role: str  # "scaling", "same global batch" or "compute only"

    @property
    def key(self):
        layout = self.layout
        where = f"{layout.processes}x{layout.threads or 'gpu'}"
        return f"{self.model.name} | {self.method.name} | {where} | b{layout.batch_size} | {self.role}"


@dataclass
class Machine:
    gpus: int
    cores: int
    skipped: dict = field(default_factory=dict)


def process_counts(machine):
    """Processes for the distributed methods: every GPU count in 1, 2, 4, ... up to all GPUs; on a
    CPU, every count from 2 that divides the cores (each process then gets cores / count threads)."""
    if machine.gpus:
        counts = {2**i for i in range(int(math.log2(machine.gpus)) + 1)} | {machine.gpus}
        return sorted(counts)
    return [n for n in range(2, machine.cores + 1) if machine.cores % n == 0]


def threads_for(processes, machine):
    return None if machine.gpus else machine.cores // processes


def plan(methods, models, machine):
    """Every run of one repeat, in the order they alternate."""
    runs = []
    for model in models:
        batch, counts = model.batch_size, process_counts(machine)
        for method in methods:
            if method.needs_gpu and not machine.gpus:
                machine.skipped[method.name] = method.needs_gpu
                continue
            if method.distributed:
                runs += [Run(method, model, Layout(n, threads_for(n, machine), batch), "scaling") for n in counts]
            elif method.script == "step3_data_parallel.py":
                runs.append(Run(method, model, Layout(1, None, batch), "scaling"))  # batch per GPU
            else:
                runs += single_process_runs(method, model, machine, counts)
        if machine.gpus == 0 and counts:  # the per-process step with no communication, N at once
            single = next((m for m in methods if m.name == "one process"), METHODS[0])
            runs += [Run(single, model, Layout(n, threads_for(n, machine), batch), "compute only") for n in counts]
    return runs


def single_process_runs(method, model, machine, counts):
    batch = model.batch_size
    if machine.gpus:
        return [Run(method, model, Layout(1, None, batch), "scaling")]
    runs = [Run(method, model, Layout(1, 1, batch), "scaling"),  # one core: the unit of scaling efficiency
            Run(method, model, Layout(1, machine.cores, batch), "scaling")]
    if counts and method.name == "one process":  # the same global batch as the largest distributed run
        runs.append(Run(method, model, Layout(1, machine.cores, batch * max(counts)), "same global batch"))
    return runs


def command(run, results_dir, name, epochs):
    script = str(common.SCRIPTS / run.method.script)
    layout, model = run.layout, run.model
    args = ["--epochs", str(epochs), "--batch-size", str(layout.batch_size), "--results-dir", str(results_dir),
            "--run-name", name, *model.args, *run.method.args]
    if layout.threads:
        args += ["--threads", str(layout.threads)]
    steps = steps_per_process(run, model)
    if steps:
        args += ["--max-steps", str(steps)]
    if run.method.distributed:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={layout.processes}", script, *args]
    return [sys.executable, script, *args]


def steps_per_process(run, model):
    """--max-steps: the model's cap, and for "compute only" the steps each distributed process takes."""
    if run.role != "compute only":
        return model.max_steps
    per_process = math.ceil(model.train_size / run.layout.processes)
    steps = math.ceil(per_process / run.layout.batch_size)
    return min(steps, model.max_steps) if model.max_steps else steps


def launch(run, results_dir, name, epochs):
    """Start a run (the "compute only" ones as N processes at once); returns [(returncode, output)]."""
    copies = run.layout.processes if run.role == "compute only" else 1
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    children = [subprocess.Popen(command(run, results_dir, f"{name}-{i}" if copies > 1 else name, epochs),
                                 cwd=common.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(copies)]
    return [(child.wait(), child.stdout.read()) for child in children]


def why_not_accepted(output):
    """The script's one-line reason when it does not accept an entry yet, else None."""
    for line in output.splitlines():
        if any(marker in line for marker in NOT_ACCEPTED):
            return line.strip()
    return None


def steady_throughput(record):
    """Samples/s of one run in steady state: each epoch's rate without the process's warm-up steps
    (the scripts leave the first steps out), averaged over the epochs."""
    rates = [epoch["steady_samples_per_second"] for epoch in record["per_epoch"]
             if epoch.get("steady_samples_per_second")]
    return statistics.mean(rates)


def summarize(run, records):
    """One repeat of a run as numbers (``records``: one per process for "compute only")."""
    record = records[0]
    rates = [steady_throughput(r) for r in records]
    throughput = sum(rates)  # "compute only": independent processes side by side
    # A step is one batch of each process (with --accumulate, one micro-batch).
    step_seconds = statistics.mean(r["batch_size"] * r["world_size"] / rate for r, rate in zip(records, rates))
    first = record["per_epoch"][0]
    samples_per_epoch = round(first["samples_per_second"] * first["seconds"]) * len(records)
    mfus = [epoch["mfu"] for r in records for epoch in r["per_epoch"] if epoch.get("mfu") is not None]
    return {
        "samples_per_second": throughput,
        "seconds_per_epoch": samples_per_epoch / throughput,
        "step_seconds": step_seconds,
        "mfu": statistics.mean(mfus) if mfus else None,
        "peak": record.get("peak"),
        "time_to_target": time_to_target(record, run.model.target_accuracy),
        "final_test_accuracy": record["final_test_accuracy"],
        "global_batch_size": record["global_batch_size"] * len(records),
        "world_size": record["world_size"],
    }


def time_to_target(record, target):
    """Training seconds (evaluation excluded) until the first epoch at or above ``target`` accuracy
    (None without a target)."""
    if target is None:
        return None
    clock = 0.0
    for epoch in record["per_epoch"]:
        clock += epoch["seconds"]
        if epoch["test_accuracy"] >= target:
            return clock
    return None


def skip_key(run, reason):
    """A data set or model the scripts do not know skips the model; anything else, the method."""
    if "--dataset" in reason or "--model" in reason or "not found under" in reason:
        return f"model {run.model.name}"
    return f"{run.method.name} ({run.model.name})"


def is_skipped(run, machine):
    return f"model {run.model.name}" in machine.skipped or f"{run.method.name} ({run.model.name})" in machine.skipped


def run_once(run, results_dir, name, epochs, machine):
    outcomes = launch(run, results_dir, name, epochs)
    failed = [output for code, output in outcomes if code != 0]
    if failed:
        reason = why_not_accepted(failed[0])
        if reason is None:
            raise RuntimeError(f"{run.key} failed:\n{failed[0][-3000:]}")
        machine.skipped[skip_key(run, reason)] = reason
        return None
    names = [f"{name}-{i}" for i in range(len(outcomes))] if len(outcomes) > 1 else [name]
    records = [json.loads((Path(results_dir) / f"{n}.json").read_text()) for n in names]
    return summarize(run, records)


def median_of(summaries):
    """Median over repeats of every number (the first repeat's value for the rest)."""
    merged = dict(summaries[0])
    for key, value in summaries[0].items():
        values = [s[key] for s in summaries if isinstance(s.get(key), (int, float)) and not isinstance(s[key], bool)]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and len(values) == len(summaries):
            merged[key] = statistics.median(values)
    merged["repeats"] = [s["samples_per_second"] for s in summaries]
    return merged


def measure(runs, repeats, epochs, machine):
    results = {run.key: [] for run in runs}
    loads = []
    with tempfile.TemporaryDirectory() as results_dir:
        for repeat in range(1, repeats + 1):
            for index, run in enumerate(runs):
                if is_skipped(run, machine):
                    continue
                loads.append(common.load_average())
                summary = run_once(run, results_dir, f"r{repeat}-{index}", epochs, machine)
                if summary is not None:
                    results[run.key].append(summary)
                    print(f"repeat {repeat}: {run.key:<70} {summary['samples_per_second']:>9,.0f} samples/s  "
                          f"load {loads[-1]:.2f}", flush=True)
    loads.append(common.load_average())
    rows = [dict(method=run.method.name, model=run.model.name, role=run.role, **asdict(run.layout),
                 **median_of(results[run.key])) for run in runs if results[run.key]]
    return rows, loads


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default: each model's own)")
    parser.add_argument("--max-steps", type=int, default=None, help="cap every epoch at this many steps (quick runs)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="names from the METHODS table (default: all); a target whose runs are left out is "
                             "reported as not measured")
    parser.add_argument("--models", nargs="+", default=None, help="names from the MODELS table (default: all)")
    parser.add_argument("--records", type=Path, default=common.DEFAULT_RECORDS, help="where the JSON record goes")
    args = parser.parse_args(argv)
    for chosen, table in ((args.methods, METHODS), (args.models, MODELS)):
        unknown = set(chosen or []) - {entry.name for entry in table}
        if unknown:
            parser.error(f"unknown {', '.join(sorted(unknown))}; choose from: {', '.join(e.name for e in table)}")
    return args


def measure_everything(args):
    """Every chosen method and model, each model with its own number of epochs: the record, without targets."""
    methods = [m for m in METHODS if args.methods is None or m.name in args.methods]
    models = [replace(m, max_steps=args.max_steps or m.max_steps) for m in MODELS
              if args.models is None or m.name in args.models]
    machine = Machine(gpus=torch.cuda.device_count(), cores=common.usable_cores())
    epochs_by_model = {model.name: args.epochs or model.epochs for model in models}
    runs_by_epochs = {}
    for run in plan(methods, models, machine):
        runs_by_epochs.setdefault(epochs_by_model[run.model.name], []).append(run)
    rows, loads = [], []
    for epochs, group in runs_by_epochs.items():
        group_rows, group_loads = measure(group, args.repeats, epochs, machine)
        rows += group_rows
        loads += group_loads
    return {
        "benchmark": "harness", "repeats": args.repeats, "epochs": epochs_by_model,
        "machine": {"gpus": machine.gpus, "cores": machine.cores},
        "hardware": common.hardware(), "load_average": {"max": max(loads, default=None), "samples": loads},
        "models": {m.name: asdict(m) for m in models}, "rows": rows, "skipped": machine.skipped,
    }


def main(argv=None):
    args = parse_args(argv)
    record = measure_everything(args)
    # Written before the targets are judged, and again with them: what took minutes to measure is kept even if
    # judging or printing it fails.
    path = common.write_record(args.records, "harness", record)
    record["targets"] = report.check_targets(record)
    common.write_record(args.records, "harness", record, path, say=False)
    print("\n" + report.render(record))


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:
        raise SystemExit(f"error: {error}") from None
