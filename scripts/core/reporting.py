"""What a run reports: a line per epoch on rank 0, and a JSON record of the whole run."""
import json
import os
import platform
import time
from pathlib import Path

import torch

from . import mfu
from .cli import REPO

# Notebook 01 compares one epoch's FLOPs with the FP32 peaks of three GPUs.
FP32_PEAK_TFLOPS = {family: mfu.gpu_peak_tflops(name, "fp32") for family, name in (
    ("V100", "Tesla V100-SXM2-16GB"), ("A100", "NVIDIA A100-SXM4-80GB"), ("H100", "NVIDIA H100 80GB HBM3"))}
training_flops_per_sample = mfu.training_flops_per_sample


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


def display_path(path):
    """A path as the course shows it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


class RunLog:
    """Collects per-epoch metrics; rank 0 prints them and writes the JSON record."""

    def __init__(self, script, model, batches, runtime, args):
        self.runtime, self.args = runtime, args
        self.flops_per_sample = mfu.training_flops_per_sample(model, batches.sample_inputs().to(runtime.device))
        self.peak = mfu.find_peak(model, runtime.device, runtime.threads, args.precision, args.peak_tflops)
        self.world_peak = mfu.world_peak_flops(self.peak, runtime.world_size)
        self.started = time.perf_counter()
        self.seconds_before = 0.0  # training time of earlier attempts, when resumed from a checkpoint
        self.record = {
            "script": script,
            "world_size": runtime.world_size,
            "backend": runtime.backend,
            "device": str(runtime.device),
            "hardware": hardware(runtime),
            "dataset": args.dataset,
            "model": args.model,
            "loader": args.loader,
            "optimizer": args.optimizer,
            "batch_size": batches.batch_size,
            "global_batch_size": batches.batch_size * runtime.world_size,
            "epochs": args.epochs,
            "seed": args.seed,
            "flops_per_sample": self.flops_per_sample,
            "peak": self.peak.as_record(),  # what MFU is measured against: value, precision, source, TF32
            "per_epoch": [],
        }

    def restore(self, history, seconds_before):
        """Continue the record of a resumed run: its earlier epochs and their time."""
        self.record["per_epoch"] = list(history)
        self.seconds_before = seconds_before

    def elapsed(self):
        """Seconds this run has taken so far, earlier attempts included."""
        return self.seconds_before + time.perf_counter() - self.started

    def log_epoch(self, epoch, train_loss, samples, seconds, metrics, steady=None):
        """``steady``: (samples, seconds) of the epoch without the process's warm-up steps, for MFU."""
        throughput = samples / seconds
        # An epoch that ends with the warm-up has no steady samples: no rate to measure, so no MFU.
        steady_throughput = steady[0] / steady[1] if steady and steady[0] > 0 and steady[1] > 0 else None
        utilization = mfu.model_flops_utilization(steady_throughput, self.flops_per_sample, self.world_peak)
        entry = {"epoch": epoch, "train_loss": train_loss, **metrics, "seconds": seconds,
                 "samples_per_second": throughput, "steady_samples_per_second": steady_throughput,
                 "mfu": utilization}
        self.record["per_epoch"].append(entry)
        if self.runtime.is_main:
            mfu_text = f"{utilization:.1%}" if utilization is not None else "n/a"
            print(
                f"epoch {epoch}/{self.args.epochs}  train loss {train_loss:.4f}  "
                f"test loss {metrics['test_loss']:.4f}  test accuracy {metrics['test_accuracy']:.2%}  "
                f"{seconds:.2f} s  {throughput:,.0f} samples/s  MFU {mfu_text}",
                flush=True,
            )

    def finish(self):
        last = self.record["per_epoch"][-1]
        self.record.update(
            total_seconds=self.elapsed(),
            final_test_accuracy=last["test_accuracy"],
            final_test_loss=last["test_loss"],
            final_train_loss=last["train_loss"],
        )
        if self.runtime.is_main:
            self.record["path"] = self.save()
        return self.record

    def save(self):
        args = self.args
        name = args.run_name or f"{self.record['script']}-w{self.runtime.world_size}-{time.strftime('%Y%m%d-%H%M%S')}"
        path = Path(args.results_dir) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record, indent=2) + "\n")
        print(f"total {self.record['total_seconds']:.1f} s; record written to {display_path(path)}", flush=True)
        return str(path)
