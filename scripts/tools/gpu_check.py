"""Check the course's GPU path on this machine: every step on the GPUs present, with records.

    python scripts/tools/gpu_check.py                     # what `make gpu-check` runs
    python scripts/tools/gpu_check.py --dry-run --gpus 4  # print what it would run on 4 GPUs

With N GPUs: one process on one GPU (in-memory batches, then the DataLoader with pinned memory
and workers); all_reduce by hand (per parameter, one bucket) and DDP with N processes on NCCL,
each on cuda:LOCAL_RANK; DataParallel over all N; a DDP checkpoint loaded back onto a GPU with
map_location; with 2 or more GPUs the equivalence check on NCCL and the all_reduce bandwidth
sweep; every notebook, executed into a temporary folder (where Jupyter is installed); then the
benchmark harness for the MNIST Net (DataParallel, the pytorch/examples MNIST recipe against the course's
baseline, MFU against the GPU's data-sheet peak). Each step's record is checked
(device, backend, world size, GPUs counted for MFU) and all of them are written, with the
hardware, to one JSON record under --records.

Needs only python3 with torch, torchvision, tqdm and matplotlib, and the bundled data: no
virtual environment, no internet (without Jupyter it says that it skips the notebooks). Without
a GPU it runs the same steps on the CPU (2 processes, a few steps each) to check the command
itself, and says that the GPU path was not checked.
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))  # for the package benchmarks/

NEEDED = ("torch", "torchvision", "tqdm", "matplotlib")
_missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    sys.exit(f"error: {sys.executable} has no {', '.join(_missing)}; install them into it "
             f"({sys.executable} -m pip install {' '.join(_missing)}) or name a Python that has them: "
             "make gpu-check PY=/path/to/python")

import torch  # noqa: E402

from benchmarks import common  # noqa: E402 (it puts scripts/ on sys.path, for kit)
from kit import exactness  # noqa: E402

SHORT = ("--epochs", "2", "--max-steps", "20")  # enough steps to leave the first epoch's start-up behind


@dataclass
class Step:
    name: str
    command: list
    record: str | None = None  # run name of the JSON record the step writes
    checks: list = field(default_factory=list)  # (what, function(record) -> bool)
    env: dict = field(default_factory=dict)


def python(script, *args):
    return [sys.executable, str(script), *map(str, args)]


def torchrun(nproc, script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *map(str, args)]


def record_checks(device, world_size, backend, gpus_per_process=1):
    """What every training record must say about where it ran."""
    checks = [
        (f"device {device}", lambda r: r["device"] == device),
        (f"world size {world_size}", lambda r: r["world_size"] == world_size),
        (f"backend {backend or 'none'}", lambda r: r["backend"] == backend),
    ]
    checks.append((f"MFU counts {gpus_per_process} device(s) per process",
                   lambda r: r["peak"]["devices_per_process"] == gpus_per_process))
    checks.append(("MFU reported", lambda r: r["per_epoch"][-1]["mfu"] is not None))
    return checks


def exact_in_every_process(record, nproc):
    """Whether verify_equivalence.py's record shows kit/exactness.py's flags in each of its ``nproc`` processes."""
    settings = record.get("math_settings", [])
    return len(settings) == nproc and all(exactness.is_exact(one) for one in settings)


def plan(gpus, results, quick_args, records_dir):
    """Every step, for ``gpus`` GPUs (0: the CPU fallback with 2 processes)."""
    nproc = gpus or 2
    device = "cuda:0" if gpus else "cpu"
    backend = "nccl" if gpus else "gloo"
    common_args = (*quick_args, "--results-dir", results)
    checkpoint = Path(results) / "ddp.pt"
    steps = [
        Step("1 one process, in-memory batches",
             python(SCRIPTS / "step1_baseline.py", *common_args, "--run-name", "single"),
             "single", record_checks(device, 1, None)),
        Step("1 one process, DataLoader with pinned memory and 2 workers",
             python(SCRIPTS / "step1_baseline.py", *common_args, "--run-name", "pinned", "--loader", "dataloader",
                    "--workers", "2", "--pin-memory"), "pinned", record_checks(device, 1, None)),
        Step(f"2 all_reduce per parameter, {nproc} processes",
             torchrun(nproc, SCRIPTS / "step2_allreduce.py", *common_args, "--run-name", "per-parameter",
                      "--mode", "per-parameter"), "per-parameter", record_checks(device, nproc, backend)),
        Step(f"2 all_reduce bucket, {nproc} processes",
             torchrun(nproc, SCRIPTS / "step2_allreduce.py", *common_args, "--run-name", "bucket", "--mode", "bucket"),
             "bucket", record_checks(device, nproc, backend)),
        Step(f"3 DataParallel over {gpus or 'no'} GPU(s)",
             python(SCRIPTS / "step3_data_parallel.py", *common_args, "--run-name", "dp"),
             "dp", record_checks(device, 1, None, gpus_per_process=max(gpus, 1))),
        Step(f"4 DDP, {nproc} processes, saving a checkpoint",
             torchrun(nproc, SCRIPTS / "step4_ddp.py", *common_args, "--run-name", "ddp", "--save", checkpoint),
             "ddp", record_checks(device, nproc, backend)),
        Step("4 the checkpoint loads onto this machine's device (map_location), without 'module.'",
             python(SCRIPTS / "tools/gpu_check.py", "--load-checkpoint", checkpoint, "--device", device)),
    ]
    if gpus >= 2:
        # The script turns TF32 and cuDNN's free algorithm choice off in each of its processes, as in notebook 02
        # (kit/exactness.py); its record says whether every rank had them off.
        steps.append(Step(f"equivalence on NCCL, {nproc} processes (TF32 off in each: kit/exactness.py)",
                          torchrun(nproc, SCRIPTS / "demos/verify_equivalence.py",
                                   "--json", Path(results) / "equivalence.json"),
                          "equivalence", [(f"TF32 off, cuDNN deterministic and not benchmarking in all {nproc} "
                                           "processes", lambda r: exact_in_every_process(r, nproc))]))
        steps.append(Step(f"all_reduce bandwidth on NCCL, {nproc} GPUs",
                          python(BENCHMARKS / "allreduce_bandwidth.py", "--records", records_dir)))
    if gpus:
        steps += notebook_steps(results)
        steps.append(Step("benchmark harness on the GPU(s): the MNIST Net, every method",
                          python(BENCHMARKS / "harness.py", "--models", "net", "--repeats", "1",
                                 "--records", records_dir)))
    return steps


# As the Makefile's EXECUTE: the notebooks name the kernel "ddp-course", which a GPU node need not have
# registered (`make kernel`); "python3" is this Python's own kernel.
EXECUTE_NOTEBOOK = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                    "--ExecutePreprocessor.kernel_name=python3",
                    "--ExecutePreprocessor.record_timing=False"]


def notebook_steps(results):
    """Every notebook executed on this machine (their GPU cells run where there is a GPU), into a
    temporary folder: the stored notebooks keep their outputs. Needs Jupyter's nbconvert."""
    if importlib.util.find_spec("nbconvert") is None:
        print("the notebooks are not run: Jupyter's nbconvert is not installed in this Python "
              "(with the course's environment, `make test` runs them)", flush=True)
        return []
    return [Step(f"notebook {path.name}", [*EXECUTE_NOTEBOOK, "--output-dir", results, path])
            for path in sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))]


def run_step(step, results):
    started = time.perf_counter()
    done = subprocess.run(step.command, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1", **step.env),
                          capture_output=True, text=True)
    outcome = {"step": step.name, "seconds": round(time.perf_counter() - started, 1),
               "returncode": done.returncode, "checks": {}}
    if done.returncode != 0:
        outcome["output_tail"] = (done.stdout + done.stderr)[-3000:]
        return outcome
    if step.record:
        record = json.loads((Path(results) / f"{step.record}.json").read_text())
        outcome["record"] = record
        outcome["checks"] = {what: bool(check(record)) for what, check in step.checks}
    return outcome


def shown(command, results):
    """A command as a person would type it: python, paths relative to the repository."""
    words = ["python" if str(w) == sys.executable else str(w) for w in command]
    return " ".join(w.replace(str(results), "<tmp>").replace(f"{REPO}/", "") for w in words)


def passed(outcome):
    return outcome["returncode"] == 0 and all(outcome["checks"].values())


def print_outcome(outcome):
    mark = "ok  " if passed(outcome) else "FAIL"
    print(f"{mark} {outcome['step']} ({outcome['seconds']:.0f} s)", flush=True)
    for what, ok in outcome["checks"].items():
        print(f"       {'ok  ' if ok else 'FAIL'} {what}")
    if outcome["returncode"] != 0:
        print("       " + outcome["output_tail"].strip().replace("\n", "\n       "))


def environment():
    info = {"hardware": common.hardware(), "tf32": None}
    from kit import mfu

    info["tf32"] = mfu.tf32_settings()
    info["peaks"] = {name: {p: mfu.gpu_peak_tflops(name, p) for p in ("fp32", "tf32", "bf16")}
                     for name in info["hardware"]["gpus"]}
    return info


def pinned_torch():
    """The torch release requirements.txt pins (torch==X), or None."""
    pin = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M)
    return pin[1] if pin else None


def version_note(installed, pinned):
    """One line when this Python's torch is another release than the course pins, else None: the course uses
    that release's API (notebook 04 uses DDP's forward_sync_buffers, which replaced broadcast_buffers in torch
    2.13), so another torch can fail a step that the pinned one passes."""
    if pinned is None or installed.split("+")[0] == pinned:
        return None
    return (f"note: this Python has torch {installed}, the course pins {pinned} (requirements.txt): a step that "
            f"uses what {installed} lacks fails here; check with torch {pinned} (a CUDA build that suits this node: "
            f"README, \"Which CUDA build\") before reading a failure as the GPU's")


def load_checkpoint(path, device):
    """Load a DDP checkpoint as a participant would on another machine: map_location, weights only."""
    from lesson import models

    state = torch.load(path, map_location=device, weights_only=True)
    prefixed = [key for key in state if key.startswith("module.")]
    if prefixed:
        raise SystemExit(f"error: the checkpoint has 'module.' keys ({prefixed[0]}): save model.module's weights")
    model = models.Net().to(device)
    model.load_state_dict(state)  # strict: every key must match
    devices = {str(t.device) for t in model.state_dict().values()}
    print(f"loaded {len(state)} tensors onto {', '.join(sorted(devices))}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    parser.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs (default: those visible)")
    parser.add_argument("--records", type=Path, default=common.DEFAULT_RECORDS, help="where the JSON record goes")
    parser.add_argument("--load-checkpoint", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.load_checkpoint:
        return load_checkpoint(args.load_checkpoint, args.device)
    visible = torch.cuda.device_count()
    gpus = visible if args.gpus is None else args.gpus
    quick = SHORT if gpus else ("--epochs", "2", "--max-steps", "3", "--threads", "1")
    if not gpus:
        print("no CUDA GPU visible: running the same steps on the CPU (2 processes, 3 steps per epoch) to check "
              "the command itself; the GPU path is NOT checked by this run", flush=True)
    if note := version_note(torch.__version__, pinned_torch()):
        print(note, flush=True)
    with tempfile.TemporaryDirectory() as results:
        steps = plan(gpus, results, quick, args.records)
        if args.dry_run:
            for step in steps:
                env = " ".join(f"{k}={v}" for k, v in step.env.items())
                print(f"{step.name}\n    {env + ' ' if env else ''}{shown(step.command, results)}")
            return None
        # Rewritten after each step, so that a run cut short keeps the steps it made; "passed" is judged at the end.
        record = {"benchmark": "gpu_check", "gpus": gpus, "torch_pinned": pinned_torch(), "steps": [],
                  "finished": False, "passed": None}
        path = common.record_path(args.records, "gpu-check")
        print(f"record: {common.display_path(path)}, rewritten after each step", flush=True)
        for step in steps:
            record["steps"].append(run_step(step, results))
            print_outcome(record["steps"][-1])
            common.write_record(args.records, "gpu-check", record, path, say=False)
    # The hardware last, as before: asking for the GPUs' names initialises CUDA in this process, which it does
    # only once every step's processes are done.
    record.update(environment(), finished=True, passed=all(passed(o) for o in record["steps"]))
    common.write_record(args.records, "gpu-check", record, path)
    failed = [o["step"] for o in record["steps"] if not passed(o)]
    if failed:
        note = version_note(torch.__version__, pinned_torch())
        raise SystemExit(f"error: {len(failed)} step(s) failed: {'; '.join(failed)}" + (f" ({note})" if note else ""))
    where = f"{gpus} GPU(s)" if gpus else "the CPU (no GPU: GPU path NOT checked)"
    print(f"all {len(record['steps'])} steps passed on {where}")


if __name__ == "__main__":
    main()
