"""MFU by its parts: the peak table and its name rule, the precision, the devices, the FLOP count.

No GPU is needed: GPU names are strings, and where a function asks CUDA for a name the test
answers for it. Nothing here is timed.
"""
import math

import pytest
import torch
import torch.nn as nn

from kit import mfu
from lesson import models


class FakeDataParallel(nn.DataParallel):
    """A DataParallel as it looks on a machine with GPUs: a module and the GPUs it is spread over."""

    def __init__(self, module, device_ids):
        nn.Module.__init__(self)
        self.module, self.device_ids = module, device_ids


DEFAULT_TF32 = {"cudnn_conv_tf32": True, "cuda_matmul_tf32": False, "float32_matmul_precision": "highest"}
NO_TF32 = {"cudnn_conv_tf32": False, "cuda_matmul_tf32": False, "float32_matmul_precision": "highest"}


@pytest.mark.parametrize("name, fp32", [
    ("NVIDIA H100 80GB HBM3", 67.0),
    ("NVIDIA H100 PCIe", 51.0),
    ("NVIDIA A100-SXM4-40GB", 19.5),
    ("NVIDIA A100-SXM4-80GB", 19.5),
    ("NVIDIA A100 80GB PCIe", 19.5),
    ("NVIDIA A100-PCIE-40GB", 19.5),
    ("NVIDIA L4", 30.3),
    ("NVIDIA L40", 90.5),
    ("NVIDIA L40S", 91.6),
    ("NVIDIA A40", 37.4),
    ("NVIDIA A10", 31.2),
    ("Tesla V100-SXM2-32GB", 15.7),
    ("Tesla V100-PCIE-16GB", 14.0),
    ("Tesla T4", 8.1),
    ("nvidia h200", 67.0),
])
def test_known_gpus_get_their_own_fp32_peak(name, fp32):
    assert mfu.gpu_peak_tflops(name, "fp32") == fp32


@pytest.mark.parametrize("name", [
    "NVIDIA RTX A4000",  # a substring rule gave it the A40's peak
    "NVIDIA H100 NVL",  # another product than the H100 SXM
    "NVIDIA A10G",  # not the A10
    "Tesla V100S-PCIE-32GB",  # not the V100
    "NVIDIA GeForce RTX 4090",
    "NVIDIA B200",
])
def test_unknown_gpus_get_no_peak_rather_than_a_neighbours(name):
    assert mfu.gpu_peak_tflops(name, "fp32") is None


def test_l40_and_l4_are_told_apart():
    """The fault a substring match had: "NVIDIA L40" contains "L4"."""
    assert mfu.gpu_peak_tflops("NVIDIA L40", "fp32") == 90.5
    assert mfu.gpu_peak_tflops("NVIDIA L4", "fp32") == 30.3


def test_name_rule_drops_vendor_and_memory_only():
    assert mfu.normalize_gpu_name("NVIDIA A100-SXM4-80GB") == ("a100", "sxm4")
    assert mfu.normalize_gpu_name("NVIDIA H100 80GB HBM3") == ("h100",)
    assert mfu.normalize_gpu_name("Tesla V100-PCIE-32GB") == ("v100", "pcie")
    assert mfu.normalize_gpu_name("NVIDIA RTX A4000") == ("rtx", "a4000")


def test_table_is_dense_and_ordered_by_precision():
    """Tensor-core peaks are at least the FP32 one, and BF16 at least TF32 (sparse figures would break
    nothing here, so also check a known dense value: H100 SXM TF32 is half the data sheet's 989)."""
    for key, peaks in mfu.PEAK_TFLOPS.items():
        assert peaks.get("tf32", peaks["fp32"]) >= peaks["fp32"], key
        assert peaks["fp16"] >= peaks.get("tf32", peaks["fp32"]), key
    assert mfu.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(989 / 2, abs=0.5)


def test_fp32_training_on_ampere_and_later_is_measured_against_tf32():
    assert mfu.compute_precision("fp32", "NVIDIA A100-SXM4-80GB", DEFAULT_TF32) == "tf32"
    assert mfu.compute_precision("fp32", "NVIDIA A100-SXM4-80GB", NO_TF32) == "fp32"


def test_gpus_without_tf32_stay_at_fp32():
    assert mfu.compute_precision("fp32", "Tesla V100-SXM2-16GB", DEFAULT_TF32) == "fp32"
    assert mfu.compute_precision("fp32", "Tesla T4", DEFAULT_TF32) == "fp32"


def test_mixed_precision_uses_its_own_peak():
    assert mfu.compute_precision("bf16", "NVIDIA H100 80GB HBM3", NO_TF32) == "bf16"
    assert mfu.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.5


def test_tf32_settings_follow_pytorch(monkeypatch):
    assert mfu.tf32_settings()["cudnn_conv_tf32"] is torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", not torch.backends.cudnn.allow_tf32)
    assert mfu.tf32_settings()["cudnn_conv_tf32"] is torch.backends.cudnn.allow_tf32


def test_dataparallel_counts_every_gpu_it_drives():
    assert mfu.devices_per_process(FakeDataParallel(nn.Linear(2, 2), [0, 1, 2, 3])) == 4
    assert mfu.devices_per_process(nn.DataParallel(nn.Linear(2, 2), device_ids=[])) == 1  # on a CPU
    assert mfu.devices_per_process(nn.Linear(2, 2)) == 1


def test_dataparallel_peak_is_the_sum_of_its_gpus(monkeypatch):
    """step3_data_parallel on 4 A100s: MFU against 4 x the TF32 peak, not 1 x."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(mfu, "tf32_settings", lambda: DEFAULT_TF32)
    model = FakeDataParallel(nn.Linear(2, 2), [0, 1, 2, 3])
    peak = mfu.find_peak(model, torch.device("cuda", 0), threads=1)
    assert (peak.flops_per_device, peak.devices_per_process, peak.precision) == (156e12, 4, "tf32")
    assert "data sheet" in peak.source and peak.tf32 == DEFAULT_TF32
    assert mfu.world_peak_flops(peak, processes=1) == 4 * 156e12
    # 1e6 samples/s at 72 MFLOP each: 72 TFLOP/s of model arithmetic, 11.5 % of 4 x 156 TFLOP/s.
    assert mfu.model_flops_utilization(1e6, 72e6, mfu.world_peak_flops(peak, 1)) == pytest.approx(72e12 / 624e12)


def test_ddp_peak_counts_one_gpu_per_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(mfu, "tf32_settings", lambda: NO_TF32)
    peak = mfu.find_peak(nn.Linear(2, 2), torch.device("cuda", 3), threads=1)
    assert (peak.devices_per_process, peak.precision) == (1, "fp32")
    assert mfu.world_peak_flops(peak, processes=8) == 8 * 67e12


def test_unknown_gpu_reports_no_mfu_unless_the_peak_is_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A4000")
    peak = mfu.find_peak(nn.Linear(2, 2), torch.device("cuda", 0), threads=1)
    assert peak.flops_per_device is None and "not in the peak table" in peak.source
    assert mfu.model_flops_utilization(1000, 72e6, mfu.world_peak_flops(peak, 2)) is None
    given = mfu.find_peak(nn.Linear(2, 2), torch.device("cuda", 0), threads=1, given_tflops=19.2)
    assert (given.flops_per_device, given.source) == (19.2e12, "--peak-tflops")


def test_cpu_peak_is_measured():
    peak = mfu.find_peak(nn.Linear(2, 2), torch.device("cpu"), threads=torch.get_num_threads())
    assert peak.source.startswith("measured") and peak.precision == "fp32"
    assert math.isfinite(peak.flops_per_device) and peak.flops_per_device > 1e8  # any CPU does 0.1 GFLOP/s


def test_mfu_formula():
    # 1,000 samples/s x 72 MFLOP = 72 GFLOP/s, against 2 processes x 100 GFLOP/s.
    assert mfu.model_flops_utilization(1000, 72e6, 2 * 100e9) == pytest.approx(0.36)
    assert mfu.model_flops_utilization(1000, 72e6, None) is None
    assert mfu.model_flops_utilization(None, 72e6, 1e11) is None  # an epoch of warm-up steps only


def test_flop_count_of_the_net_matches_a_count_by_hand():
    """Forward: the four layers' multiply-adds x 2. Backward: twice the forward, except that conv1
    needs no gradient for its input (the images), only for its weights."""
    conv1 = 2 * (32 * 26 * 26) * (1 * 3 * 3)
    conv2 = 2 * (64 * 24 * 24) * (32 * 3 * 3)
    fc1, fc2 = 2 * 9216 * 128, 2 * 128 * 10
    forward = conv1 + conv2 + fc1 + fc2
    expected = 3 * forward - conv1
    assert mfu.training_flops_per_sample(models.Net(), torch.randn(4, 1, 28, 28)) == expected


def test_counting_leaves_the_random_stream_where_it_was():
    model = models.Net(dropout=True)
    images = torch.randn(4, 1, 28, 28)
    torch.manual_seed(0)
    mfu.training_flops_per_sample(model, images)
    after_counting = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_counting, torch.rand(3))
    # The control: the same forward pass outside the fork does move the stream (dropout draws from it).
    torch.manual_seed(0)
    model(images[:2])
    assert not torch.equal(after_counting, torch.rand(3))


def test_counting_forks_every_gpu_the_process_drives(monkeypatch):
    forked = []
    real_fork = torch.random.fork_rng

    def recording_fork(devices=None, device_type=None, **kwargs):
        forked.append((list(devices), device_type))
        return real_fork(devices=[], device_type=device_type, **kwargs)  # this machine has no GPU to fork

    monkeypatch.setattr(torch.random, "fork_rng", recording_fork)
    mfu.training_flops_per_sample(FakeDataParallel(models.Net(), [0, 1, 2]), torch.randn(2, 1, 28, 28))
    assert forked == [([0, 1, 2], "cuda")]
    assert mfu.cuda_devices_driven(nn.Linear(2, 2), torch.device("cuda", 3)) == [3]  # DDP on local GPU 3
    assert mfu.cuda_devices_driven(nn.Linear(2, 2), torch.device("cpu")) == []


def test_measuring_the_cpu_peak_leaves_the_runs_random_stream_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert mfu.measure_cpu_peak(size=64, seconds=0.01) > 0
    assert torch.equal(torch.get_rng_state(), before)  # the run's dropout masks do not depend on MFU
