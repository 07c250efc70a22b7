# Solution to notebook 08, exercise 1: time an all_reduce as section 2's benchmark does.
# Untimed warm-up calls first (the first calls set up connections and buffers), then the ranks
# start together, time back-to-back calls, and report the slowest rank's mean on every rank.
import time

import torch
import torch.distributed as dist


def time_all_reduce(tensor, warmup, iterations):
    for _ in range(warmup):
        dist.all_reduce(tensor)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    seconds = torch.tensor((time.perf_counter() - start) / iterations)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's: the collective's time
    return seconds.item()
