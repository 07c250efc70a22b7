"""What a run reports: a line per epoch on rank 0, and a JSON record of the whole run."""
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from .cli import REPO
from .distributed import unwrap

# Dense FP32 peak TFLOP/s per GPU (vendor data sheets), for MFU. Training here runs in
# FP32, so the tensor-core peaks would understate how busy the GPU is.
# Longest names first, so "H100 PCIe" wins over "H100".
FP32_PEAK_TFLOPS = {
    "H100 PCIe": 51.2, "H100": 66.9, "H200": 66.9, "GH200": 66.9, "A100": 19.5,
    "A40": 37.4, "A10": 31.2, "L40S": 91.6, "L4": 30.3, "V100": 15.7, "P100": 9.3, "T4": 8.1,
}


def peak_flops(runtime, args):
    """Peak FLOP/s of one device, or None where it is unknown (CPUs vary too much)."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if runtime.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(runtime.device)
    for key in sorted(FP32_PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return FP32_PEAK_TFLOPS[key] * 1e12
    return None


def training_flops_per_sample(model, images):
    """FLOPs of forward plus backward for one sample, counted by PyTorch's FlopCounterMode."""
    model = copy.deepcopy(unwrap(model))  # a copy: the real model's grads and hooks stay untouched
    sample = images[:2]
    counter = FlopCounterMode(display=False)
    with torch.random.fork_rng(devices=[]), counter:  # dropout here must not shift the run's RNG
        model(sample).sum().backward()
    return counter.get_total_flops() / len(sample)


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
        self.flops_per_sample = training_flops_per_sample(model, batches.sample_inputs().to(runtime.device))
        self.peak = peak_flops(runtime, args)
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
        mfu = None
        if self.peak and steady and steady[1] > 0:
            mfu = steady[0] / steady[1] * self.flops_per_sample / (self.peak * self.runtime.world_size)
        entry = {"epoch": epoch, "train_loss": train_loss, **metrics, "seconds": seconds,
                 "samples_per_second": throughput, "mfu": mfu}
        self.record["per_epoch"].append(entry)
        if self.runtime.is_main:
            mfu_text = f"{mfu:.1%}" if mfu is not None else "n/a"
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
