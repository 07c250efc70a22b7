"""Model FLOP utilisation (MFU): the share of the hardware's peak that training turns into model arithmetic.
Kit: a learner may skip this module (notebooks 01 and 08 explain MFU).

    MFU = samples/s x FLOPs per sample / (peak FLOP/s per device x devices per process x processes)

Four things decide whether that number can be trusted, and each has a function here:
- ``training_flops_per_sample``: forward + backward FLOPs of one sample, counted by PyTorch's
  FlopCounterMode (matrix products and convolutions, the usual MFU convention), on a copy of the
  model, with the random generators of the CPU and of every GPU the process drives forked, so that
  counting leaves the run's dropout masks where they were;
- ``devices_per_process``: DataParallel drives every GPU it was given from one process;
- ``gpu_peak_tflops`` and ``compute_precision``: a GPU's data-sheet peak for the precision the run
  lets it use. cuDNN runs FP32 convolutions in TF32 by default on Ampere and later, so an FP32 run
  there is measured against the TF32 peak, not the (far lower) FP32 one;
- ``measure_cpu_peak``: a CPU has no data-sheet number that fits every machine, so its peak is
  measured by each process at its start, with a short matrix product in the run's precision and thread count.
"""
import copy
import os
import re
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

# Dense peak TFLOP/s per GPU, from NVIDIA's data sheets. The data sheets print the tensor-core
# figures "with sparsity" (2:4 structured sparsity); dense training gets half of that, which is
# what is listed here. Keys are GPU names normalised by ``normalize_gpu_name``.
#   H100 SXM and PCIe: NVIDIA H100 Tensor Core GPU data sheet (FP32 67 / 51; TF32 989* / 756*;
#     BF16 and FP16 1,979* / 1,513*). H200 and GH200: their data sheets list the H100 SXM's figures.
#   A100 (SXM4 and PCIe alike): NVIDIA A100 data sheet (FP32 19.5; TF32 156, 312*; BF16 and FP16 312).
#   L40S, L40, L4, A40, A10: their data sheets (FP32 91.6 / 90.5 / 30.3 / 37.4 / 31.2;
#     TF32 366* / 181* / 120* / 149.6* / 125*; BF16 and FP16 733* / 362.1* / 242* / 299.4* / 250*).
#   V100 (SXM2 / PCIe) and T4 predate TF32 and BF16: V100 data sheet (FP32 15.7 / 14; FP16
#     tensor 125 / 112), T4 data sheet (FP32 8.1; FP16 tensor 65).
# A GPU missing here (or a variant such as "H100 NVL") gets no MFU unless --peak-tflops is given.
PEAK_TFLOPS = {
    ("h100",): {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},  # SXM5: "NVIDIA H100 80GB HBM3"
    ("h100", "pcie"): {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    ("h200",): {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    ("gh200",): {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    ("a100", "sxm4"): {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    ("a100", "pcie"): {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    ("l40s",): {"fp32": 91.6, "tf32": 183.0, "bf16": 366.5, "fp16": 366.5},
    ("l40",): {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05},
    ("l4",): {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    ("a40",): {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
    ("a10",): {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    ("v100", "sxm2"): {"fp32": 15.7, "fp16": 125.0},
    ("v100", "pcie"): {"fp32": 14.0, "fp16": 112.0},
    ("t4",): {"fp32": 8.1, "fp16": 65.0},
}

# Words in a GPU's name that do not change its arithmetic: the vendor and the memory.
IGNORED_NAME_TOKENS = re.compile(r"nvidia|tesla|\d+gb|hbm\d*e?")

CPU_GEMM_SIZE = 512  # large enough to run at the BLAS library's full speed, small enough to take milliseconds
# Every training process on a CPU measures at its start, so the window is short. On the 2-core machine the
# course's tests run on (about 100 GFLOP/s a thread: some 18 products in 0.05 s), windows of 0.05 s found the
# same median peak as windows of 0.2 s, within about 1 % (12 of each idle, 8 beside two busy processes).
CPU_GEMM_SECONDS = 0.05


def normalize_gpu_name(name):
    """The words of a GPU name that identify its model, in order, lower case.

    The rule: split on spaces and hyphens, lower-case, drop the vendor ("NVIDIA", "Tesla") and the
    memory ("80GB", "HBM3"). Everything else must then equal a table key exactly, so "NVIDIA L40"
    never takes the L4's peak, "NVIDIA RTX A4000" never the A40's, "NVIDIA H100 NVL" never the
    H100 SXM's: a word left over means another product.
    """
    tokens = re.split(r"[\s\-]+", name.strip().lower())
    return tuple(t for t in tokens if t and not IGNORED_NAME_TOKENS.fullmatch(t))


def gpu_peak_tflops(name, precision):
    """Dense peak TFLOP/s of the GPU called ``name`` in ``precision``, or None when unknown."""
    return PEAK_TFLOPS.get(normalize_gpu_name(name), {}).get(precision)


def tf32_settings():
    """What PyTorch lets CUDA do with FP32 tensors, recorded with every run.

    The defaults: cuDNN convolutions may use TF32 (``torch.backends.cudnn.allow_tf32`` is True),
    matrix products may not (``torch.backends.cuda.matmul.allow_tf32`` is False, float32 matmul
    precision "highest"). Reading them needs no GPU.
    """
    return {
        "cudnn_conv_tf32": torch.backends.cudnn.allow_tf32,
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def compute_precision(run_precision, gpu_name, settings):
    """The precision whose peak a GPU run is measured against.

    Mixed precision (bf16, fp16) runs its matrix products in that type. An FP32 run may still use
    TF32 tensor cores where the settings allow it and the GPU has them (Ampere and later); then the
    TF32 peak is the honest bound. It is the fastest math the run allows, so MFU errs on the low
    side when only the convolutions use TF32 (the default), never on the high side.
    """
    if run_precision != "fp32":
        return run_precision
    uses_tf32 = settings["cudnn_conv_tf32"] or settings["cuda_matmul_tf32"]
    return "tf32" if uses_tf32 and gpu_peak_tflops(gpu_name, "tf32") else "fp32"


def measure_cpu_peak(dtype=torch.float32, size=CPU_GEMM_SIZE, seconds=CPU_GEMM_SECONDS):
    """FLOP/s of the best of repeated (size x size) @ (size x size) products, with this process's threads.

    The best, not the mean: on a shared machine the fastest repeat is the one least disturbed.
    """
    # A generator of its own: the run's random stream (dropout masks) must not depend on whether MFU is measured.
    numbers = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, dtype=dtype, generator=numbers) for _ in range(2))
    a @ b  # the first product pays for allocation and thread start-up
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def devices_per_process(model):
    """GPUs one process drives: all of DataParallel's, else one (DDP and the others: one each)."""
    if isinstance(model, nn.DataParallel):
        return max(1, len(model.device_ids))  # on a CPU DataParallel has no device_ids
    return 1


def cuda_devices_driven(model, device):
    """Indices of the GPUs this process computes on (empty on a CPU)."""
    if isinstance(model, nn.DataParallel) and model.device_ids:
        return list(model.device_ids)
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


def training_flops_per_sample(model, images):
    """FLOPs of forward plus backward for one sample, counted by PyTorch's FlopCounterMode.

    A copy of the unwrapped model runs two samples: the real model's gradients, hooks and
    BatchNorm statistics stay untouched. The random generators of the CPU and of every GPU the
    process drives are forked, so the dropout masks drawn here do not shift the run's own (forking
    every GPU of the machine would instead create a CUDA context on each, in every process).
    """
    devices = cuda_devices_driven(model, images.device)
    plain = copy.deepcopy(getattr(model, "module", model))
    sample = images[:2]
    counter = FlopCounterMode(display=False)
    with torch.random.fork_rng(devices=devices, device_type="cuda"), counter:
        plain(sample).sum().backward()
    return counter.get_total_flops() / len(sample)


@dataclass
class Peak:
    """The peak a run's MFU is measured against, and where it comes from."""

    flops_per_device: float | None  # None: unknown, MFU is not reported
    devices_per_process: int
    precision: str  # the arithmetic the peak is for: fp32, tf32, bf16 or fp16
    source: str  # "data sheet: ...", "measured: ...", "--peak-tflops" or why it is unknown
    tf32: dict

    def as_record(self):
        return asdict(self)


def find_peak(model, device, threads, run_precision="fp32", given_tflops=None):
    """The peak of one process: given, looked up for its GPU, or measured on its CPU."""
    settings = tf32_settings()
    devices = devices_per_process(model)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        precision = compute_precision(run_precision, name, settings)
        tflops = gpu_peak_tflops(name, precision)
        source = f"data sheet: {name}, dense {precision}" if tflops else f"{name} is not in the peak table"
    else:
        precision = run_precision
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(run_precision, torch.float32)
        tflops = measure_cpu_peak(dtype) / 1e12
        size, load = f"{CPU_GEMM_SIZE}x{CPU_GEMM_SIZE}", os.getloadavg()[0]
        source = (f"measured: {size} {precision} matrix product, {threads} thread(s), best of {CPU_GEMM_SECONDS} s "
                  f"(1-minute load average {load:.2f}: other work on the machine lowers it)")
    if given_tflops:
        tflops, source = given_tflops, "--peak-tflops"
    return Peak(tflops * 1e12 if tflops else None, devices, precision, source, settings)


def world_peak_flops(peak, processes):
    """Peak FLOP/s of every device of every process: the processes are alike (one GPU each, or the
    same share of a CPU's cores), so this process's peak stands for each of them."""
    if peak.flops_per_device is None:
        return None
    return peak.flops_per_device * peak.devices_per_process * processes


def model_flops_utilization(samples_per_second, flops_per_sample, total_peak_flops):
    """MFU: model FLOP/s achieved over the peak FLOP/s of all devices together (None if unknown)."""
    if not total_peak_flops or samples_per_second is None:
        return None
    return samples_per_second * flops_per_sample / total_peak_flops
