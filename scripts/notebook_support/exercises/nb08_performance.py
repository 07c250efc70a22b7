"""The checks of 08_performance.ipynb's exercises: the participant's timing of an all_reduce, run in 2 processes, and
the share of a step spent communicating. Notebook support: a learner may skip this module.
"""
import math
import time
import timeit

import torch
import torch.distributed as dist

from . import in_processes
from .registry import exercise

# The check's clock, an artificial one: on it every all_reduce takes a fixed time, a different one on each rank,
# and the first call of a run takes FIRST_CALL_SECONDS more (connections and buffers are set up then, as in real
# runs). Each way of getting the number wrong then gives a number of its own, whatever the machine.
CALL_SECONDS = {0: 0.001, 1: 0.003}
FIRST_CALL_SECONDS = 0.020
CLOCKS = ("perf_counter", "time", "monotonic")  # and each one's _ns twin, and timeit.default_timer
WARMUP, ITERATIONS = 2, 5


def timing_in_rank(answer, work):
    """In each of 2 processes: the participant's time_all_reduce on the check's clock. The answer (section 2's,
    nccl-tests' -a 3) is the slowest rank's mean over the timed calls, the same on every rank."""
    rank = dist.get_rank()
    clock, calls = {"now": 0.0, "reads": 0}, []
    real_all_reduce = dist.all_reduce

    def all_reduce(*args, **kwargs):
        clock["now"] += CALL_SECONDS[rank] + (FIRST_CALL_SECONDS if not calls else 0.0)
        calls.append(clock["now"])
        return real_all_reduce(*args, **kwargs)

    def seconds():
        clock["reads"] += 1
        return clock["now"]

    fake_clocks = {**{(time, name): seconds for name in CLOCKS}, (timeit, "default_timer"): seconds,
                   **{(time, f"{name}_ns"): (lambda: round(seconds() * 1e9)) for name in CLOCKS}}
    with in_processes.replaced(answer, {**fake_clocks, (dist, "all_reduce"): all_reduce}):
        got = float(answer.time_all_reduce(torch.ones(2**18), WARMUP, ITERATIONS))
    both = [None, None]
    dist.all_gather_object(both, got)  # the check's one collective, after the participant's code
    hint = timing_mistake(both, len(calls)) if clock["reads"] else (
        "your code never read the check's clock, which stands in for time.perf_counter, time.time and "
        "time.monotonic: time the calls with one of them")
    if hint:
        raise in_processes.Wrong(f"rank 0 returned {both[0] * 1e3:.3f} ms and rank 1 {both[1] * 1e3:.3f} ms: {hint}")
    return got


def timing_mistake(both, calls):
    """What the two ranks' numbers say went wrong, or None when both hold the slowest rank's mean."""
    slowest, first, n = CALL_SECONDS[1], FIRST_CALL_SECONDS, ITERATIONS
    if all(math.isclose(got, slowest, rel_tol=1e-6) for got in both):
        return None
    if calls < WARMUP + ITERATIONS:
        return (f"your code made {calls} all_reduce calls: {WARMUP} untimed warm-up calls, then {ITERATIONS} timed "
                "ones (and one more to share the result)")
    known = [([CALL_SECONDS[0], slowest], "each rank reports its own mean: report the slowest rank's on every rank "
                                          "(all_reduce the time with ReduceOp.MAX)"),
             ([CALL_SECONDS[0]] * 2, "this is the fastest rank's mean (or rank 0's): report the slowest rank's"),
             ([sum(CALL_SECONDS.values()) / 2] * 2, "this is the mean over the ranks: report the slowest rank's "
                                                    "(ReduceOp.MAX), whose wait covers the whole collective"),
             ([slowest * n] * 2, "this is the time of all the timed calls together: divide by the iterations"),
             ([(first + slowest * (WARMUP + n)) / n] * 2, "the warm-up calls were timed too: start the clock after "
                                                            "them"),
             ([slowest * 1e3] * 2, "these are milliseconds: return seconds")]
    for values, hint in known:
        if all(math.isclose(got, value, rel_tol=1e-6) for got, value in zip(both, values)):
            return hint
    return "not the seconds per all_reduce of the slowest rank, after the warm-up, the same on every rank"


@exercise(1, answers=("time_all_reduce",), rank_check=timing_in_rank)
def check_all_reduce_timing(time_all_reduce):
    seconds = in_processes.run_check(timing_in_rank, time_all_reduce=time_all_reduce)
    return (f"{seconds * 1e3:.0f} ms on every rank: on the check's artificial clock rank 0's calls took "
            f"{CALL_SECONDS[0] * 1e3:.0f} ms, rank 1's {CALL_SECONDS[1] * 1e3:.0f} ms, and each rank's first call "
            f"{FIRST_CALL_SECONDS * 1e3:.0f} ms more. On a real machine the ranks leave a blocking collective at "
            "about the same time, and their times differ by when each one entered it: the largest, that of the "
            "rank which entered first, covers the whole collective. benchmarks/allreduce_bandwidth.py reports it, as "
            "nccl-tests does with -a 3 (its default, -a 1, is the mean over ranks). On GPUs, call "
            "torch.cuda.synchronize() before reading the clock: an NCCL call returns before the GPU has done the "
            "work.")


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
