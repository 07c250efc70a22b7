"""The checks of 08_performance.ipynb's exercises: bus bandwidth from algorithm bandwidth, and the share of a step spent
communicating. Notebook support: a learner may skip this module.
"""
import math

from .registry import exercise


def _ring_bus_bandwidth(algbw, ranks):
    """nccl-tests' all_reduce correction: a ring moves 2(n-1)/n of the message through each rank's link."""
    return algbw * 2 * (ranks - 1) / ranks


@exercise(1, answers=("bus_bandwidth",))
def check_bus_bandwidth(bus_bandwidth):
    for ranks in range(1, 9):
        expected = _ring_bus_bandwidth(10.0, ranks)
        got = bus_bandwidth(10.0, ranks)
        assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12), (
            f"bus_bandwidth(10.0, {ranks}) = {got}: count what one rank sends in a ring all_reduce "
            "(a reduce-scatter, then an all-gather, each in chunks of 1/n of the message)")
    return ("For 2 ranks busbw equals algbw; for 8 it is 1.75 x algbw. busbw is what each rank's link carries, "
            "so it can be set against the link's own bandwidth whatever the number of ranks.")


def _communication_share(batch, flops_per_sample, flops_per_second, gradient_bytes, busbw, ranks):
    compute = batch * flops_per_sample / flops_per_second
    communication = gradient_bytes * 2 * (ranks - 1) / ranks / busbw
    return communication / (compute + communication)


@exercise(2, answers=("communication_share",))
def check_communication_share(communication_share):
    net = dict(flops_per_sample=71.6e6, gradient_bytes=4.8e6)  # the Net: FLOPs per sample, fp32 gradients
    # CPU: the committed records' rates. A 1-thread process of the harness (harness-20261123-132818.json, 2 x 1
    # thread, "compute only") steps 64 images in 97 ms: 64 x 71.6 MFLOP / 97 ms = 47 GFLOP/s. The Net's gradients
    # in one bucket reached 0.66 GB/s (allreduce-20261123-161021.json, 2 ranks, gloo).
    # GPU: the rate the Net reached on one H200 at batch 64 (gpu/harness-20261126-141324.json: 26,503 samples/s x
    # 71.6 MFLOP = 1.9 TFLOP/s; a world of one, torch 2.11), not a data-sheet peak; the step is overhead-bound, so
    # the rate holds at batch 64 only. Links at their data-sheet line rates each way, a rough scale for busbw and
    # not a bound on it: an H200's NVLink, 450 GB/s (900 GB/s both ways); one InfiniBand NDR port, 50 GB/s
    # (400 Gb/s). Over that NVLink NCCL's ring reaches a busbw of about 370 GB/s, and NVLink SHARP (NCCL's default
    # all_reduce there) about 480 GB/s on 8 GPUs (NCCL's maintainer in https://github.com/NVIDIA/nccl-tests/issues/212;
    # 475 GB/s measured on 8 H200 in https://github.com/NVIDIA/nccl-tests/issues/272).
    cases = [(32, 47e9, 0.66e9, 2), (64, 47e9, 0.66e9, 2), (64, 1.9e12, 450e9, 8), (64, 1.9e12, 50e9, 16)]
    for batch, flops_per_second, busbw, ranks in cases:
        expected = _communication_share(batch, net["flops_per_sample"], flops_per_second, net["gradient_bytes"],
                                        busbw, ranks)
        got = communication_share(batch, net["flops_per_sample"], flops_per_second, net["gradient_bytes"],
                                  busbw, ranks)
        assert math.isclose(got, expected, rel_tol=1e-6), (
            f"batch {batch}, {flops_per_second:.0e} FLOP/s, busbw {busbw:.0e} B/s, {ranks} ranks: you get {got:.3f}; "
            "compute grows with the batch, the gradient all_reduce does not (and is 2(n-1)/n of the bytes per link)")
    shares = [_communication_share(b, net["flops_per_sample"], f, net["gradient_bytes"], w, n) for b, f, w, n in cases]
    return (f"The Net on a 2-core CPU, at the committed records' rates (47 GFLOP/s per 1-thread process, the bucket "
            f"at 0.66 GB/s): {shares[0]:.0%} of a step is communication at batch 32, {shares[1]:.0%} at 64. The "
            "harness measured 16% at 64 (18 of 115 ms): in a real step the all_reduce also waits for the slower rank "
            "and shares the two cores with the other process. At the 1.9 TFLOP/s the Net reached on one H200 (one "
            "GPU, torch 2.11, batch 64), with busbw set to the links' line rates each way (a rough scale: NCCL's ring "
            "reaches less over NVLink, NVLink SHARP more): "
            f"{shares[2]:.1%} among 8 GPUs over NVLink (450 GB/s), {shares[3]:.0%} among 16 over InfiniBand NDR "
            "(50 GB/s). The GPU computes 40 times faster than a CPU process, so only a far faster link keeps the "
            "share small. (On that GPU the arithmetic was a small part of the step: MFU 0.38 %.)")
