"""The checks of 08_performance.ipynb's exercises: the participant's timing of an all_reduce, run in 2 processes, and
the share of a step spent communicating. Notebook support: a learner may skip this module.
"""
import math
import time

import torch
import torch.distributed as dist

from . import in_processes
from .registry import exercise

# The check's clock: on it, every all_reduce takes this long, a different time on each rank, so that each way of
# getting the number wrong gives a number of its own. A real clock would make the verdict depend on the machine.
CALL_SECONDS = {0: 0.001, 1: 0.003}
CLOCKS = ("perf_counter", "time", "monotonic")  # and each one's _ns twin


def timing_in_rank(answer, work):
    """In each of 2 processes: the participant's time_all_reduce, on a clock that each all_reduce moves forward by
    CALL_SECONDS[rank]; nccl-tests' answer is the slowest rank's mean, the same on every rank."""
    rank, warmup, iterations = dist.get_rank(), 2, 5
    clock = {"now": 0.0}
    real_all_reduce = dist.all_reduce

    def all_reduce(*args, **kwargs):
        clock["now"] += CALL_SECONDS[rank]
        return real_all_reduce(*args, **kwargs)

    fake_clocks = {**{(time, name): (lambda: clock["now"]) for name in CLOCKS},
                   **{(time, f"{name}_ns"): (lambda: round(clock["now"] * 1e9)) for name in CLOCKS}}
    with in_processes.replaced(answer, {**fake_clocks, (dist, "all_reduce"): all_reduce}):
        got = float(answer.time_all_reduce(torch.ones(2**18), warmup, iterations))
    slowest, own = CALL_SECONDS[1], CALL_SECONDS[rank]
    mistakes = [(own, "this rank's own mean: nccl-tests reports the slowest rank's, the same on every rank "
                      "(all_reduce the time with ReduceOp.MAX)"),
                (sum(CALL_SECONDS.values()) / 2, "the mean over the ranks: report the slowest rank's "
                                                 "(ReduceOp.MAX), which every rank waited for"),
                (slowest * iterations, "the time of all the timed calls together: divide by the iterations"),
                (slowest * (warmup + iterations) / iterations, "the warm-up calls were timed too: start the clock "
                                                               "after them")]
    if not math.isclose(got, slowest, rel_tol=1e-6):
        hint = next((hint for value, hint in mistakes if math.isclose(got, value, rel_tol=1e-6)),
                    "not the seconds per all_reduce of the slowest rank")
        raise in_processes.Wrong(f"rank {rank}: {got * 1e3:.3f} ms is {hint}")
    return got


@exercise(1, answers=("time_all_reduce",), rank_check=timing_in_rank)
def check_all_reduce_timing(time_all_reduce):
    seconds = in_processes.run_check(timing_in_rank, time_all_reduce=time_all_reduce)
    return (f"{seconds * 1e3:.0f} ms: on the check's clock rank 0's calls took {CALL_SECONDS[0] * 1e3:.0f} ms and "
            f"rank 1's {CALL_SECONDS[1] * 1e3:.0f} ms, and every rank reports the slower. A collective ends on every "
            "rank only when the slowest has joined, so the slowest rank's time is the collective's; "
            "benchmarks/allreduce_bandwidth.py times it the same way. (On GPUs, also call "
            "torch.cuda.synchronize() before reading the clock: NCCL calls return before the work is done.)")


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
