"""What a run reports: rank 0's line per epoch, the JSON record, MFU, a progress bar. Machinery: a learner
may skip this module.

MFU is measured over the steady part of each epoch: the first ``WARMUP_STEPS`` steps of a process pay
for memory allocation, kernel selection and the first communication set-up (kit/mfu.py).
"""
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kit import mfu
from kit.output_paths import display_path
from lesson.loop import Callback, sum_over_ranks, synchronize

WARMUP_STEPS = 3


def cpu_name():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(runtime):
    info = {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "threads_per_process": runtime.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


class RunRecord(Callback):
    """Collects per-epoch metrics; rank 0 prints them and writes the JSON record."""

    def __init__(self, script, args, runtime):
        self.script, self.args, self.runtime = script, args, runtime
        self.started = time.perf_counter()
        self.seconds_before = 0.0  # training time of earlier attempts, when resumed from a checkpoint
        self.steps = 0  # steps this process has taken (a resumed process starts again at 0)
        self.steady_from = self.steady_started = None
        self.record = None

    @property
    def history(self):
        return self.record["per_epoch"]

    def on_train_start(self, trainer):
        args, runtime, batches = self.args, self.runtime, trainer.batches
        self.flops_per_sample = mfu.training_flops_per_sample(trainer.model, batches.sample_inputs().to(runtime.device))
        self.peak = mfu.find_peak(trainer.model, runtime.device, runtime.threads, args.precision, args.peak_tflops)
        self.world_peak = mfu.world_peak_flops(self.peak, runtime.world_size)
        self.record = {
            "script": self.script, "world_size": runtime.world_size, "backend": runtime.backend,
            "device": str(runtime.device), "hardware": hardware(runtime), "dataset": args.dataset, "model": args.model,
            "loader": args.loader, "optimizer": args.optimizer, "batch_size": batches.batch_size,
            "global_batch_size": batches.batch_size * runtime.world_size, "epochs": args.epochs, "seed": args.seed,
            "flops_per_sample": self.flops_per_sample,
            "peak": self.peak.as_record(),  # what MFU is measured against: value, precision, source, TF32
            "per_epoch": [],
        }

    def restore(self, history, seconds_before, resumed_at_step):
        """Continue the record of a resumed run: its earlier epochs and their time."""
        self.record["per_epoch"] = list(history)
        self.record["resumed_at_step"] = resumed_at_step
        self.seconds_before = seconds_before

    def elapsed(self):
        """Seconds this run has taken so far, earlier attempts included."""
        return self.seconds_before + time.perf_counter() - self.started

    def on_epoch_start(self, trainer):
        self.steady_from = trainer.samples if self.steps >= WARMUP_STEPS else None
        self.steady_started = time.perf_counter()

    def on_step_end(self, trainer):
        self.steps += 1
        if self.steps == WARMUP_STEPS:
            synchronize(self.runtime.device)
            self.steady_started, self.steady_from = time.perf_counter(), trainer.samples

    def on_evaluation_start(self, trainer):
        steady_samples = trainer.samples - self.steady_from if self.steady_from is not None else 0
        steady_samples, = sum_over_ranks([steady_samples], self.runtime)
        synchronize(self.runtime.device)
        self.steady = ((int(steady_samples), time.perf_counter() - self.steady_started)
                       if self.steady_from is not None else None)

    def on_epoch_end(self, trainer, metrics):
        """The epoch's entry in the record and, on rank 0, its line."""
        throughput = metrics["trained_samples"] / metrics["seconds"]  # a resumed epoch: since the resume
        steady = self.steady  # an epoch that ends with the warm-up has no steady samples: no rate, so no MFU
        steady_throughput = steady[0] / steady[1] if steady and steady[0] > 0 and steady[1] > 0 else None
        utilization = mfu.model_flops_utilization(steady_throughput, self.flops_per_sample, self.world_peak)
        entry = {"epoch": metrics["epoch"], "train_loss": metrics["train_loss"],
                 **{key: metrics[key] for key in ("test_loss", "test_accuracy", "test_samples", "first_indices")},
                 "seconds": metrics["seconds"], "samples_per_second": throughput,
                 "steady_samples_per_second": steady_throughput, "mfu": utilization}
        self.record["per_epoch"].append(entry)
        if self.runtime.is_main:
            mfu_text = f"{utilization:.1%}" if utilization is not None else "n/a"
            print(f"epoch {metrics['epoch']}/{self.args.epochs}  train loss {metrics['train_loss']:.4f}  "
                  f"test loss {metrics['test_loss']:.4f}  test accuracy {metrics['test_accuracy']:.2%}  "
                  f"{metrics['seconds']:.2f} s  {throughput:,.0f} samples/s  MFU {mfu_text}", flush=True)

    def on_train_end(self, trainer):
        last = self.record["per_epoch"][-1]
        self.record.update(total_seconds=self.elapsed(), final_test_accuracy=last["test_accuracy"],
                           final_test_loss=last["test_loss"], final_train_loss=last["train_loss"])
        if self.runtime.is_main:
            self.record["path"] = self.save()

    def save(self):
        args = self.args
        name = args.run_name or f"{self.script}-w{self.runtime.world_size}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = Path(args.results_dir) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record, indent=2) + "\n")
        print(f"total {self.record['total_seconds']:.1f} s; record written to {display_path(path)}", flush=True)
        return str(path)


class ProgressBar(Callback):
    """tqdm's bar over the epoch's batches, on rank 0 and only on a terminal (a job's log gets the lines)."""

    def __init__(self, runtime):
        self.shown = runtime.is_main and sys.stderr.isatty()
        self.bar = None

    def on_epoch_start(self, trainer):
        self.bar = tqdm(total=trainer.epoch_batches, initial=trainer.batches_done, desc=f"epoch {trainer.epoch}",
                        disable=not self.shown, leave=False)

    def on_step_end(self, trainer):
        self.bar.update(trainer.batches_done - self.bar.n)

    def on_evaluation_start(self, trainer):
        self.bar.close()
