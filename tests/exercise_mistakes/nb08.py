"""Notebook 08, exercise 1: time an all_reduce as section 2's benchmark does (the slowest rank's mean, after a
warm-up)."""
import time

import torch
import torch.distributed as dist

EXERCISE = "08.1"


def own_rank(tensor, warmup, iterations):
    for _ in range(warmup):
        dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    return (time.perf_counter() - started) / iterations  # each rank its own


def mean_of_ranks(tensor, warmup, iterations):
    for _ in range(warmup):
        dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    seconds = torch.tensor((time.perf_counter() - started) / iterations)
    dist.all_reduce(seconds)
    return seconds.item() / dist.get_world_size()


def total(tensor, warmup, iterations):
    for _ in range(warmup):
        dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    seconds = torch.tensor(time.perf_counter() - started)  # not divided by the iterations
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def warmup_timed(tensor, warmup, iterations):
    started = time.perf_counter()
    for _ in range(warmup + iterations):
        dist.all_reduce(tensor)
    seconds = torch.tensor((time.perf_counter() - started) / iterations)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def no_warmup(tensor, warmup, iterations):
    started = time.perf_counter()
    for _ in range(iterations):  # the first call, which sets up connections, is timed
        dist.all_reduce(tensor)
    seconds = torch.tensor((time.perf_counter() - started) / iterations)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def fastest(tensor, warmup, iterations):
    for _ in range(warmup):
        dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    seconds = torch.tensor((time.perf_counter() - started) / iterations)
    dist.all_reduce(seconds, op=dist.ReduceOp.MIN)
    return seconds.item()


def datetime_clock(tensor, warmup, iterations):
    import datetime

    for _ in range(warmup):
        dist.all_reduce(tensor)
    started = datetime.datetime.now()  # a clock the check does not stand in for
    for _ in range(iterations):
        dist.all_reduce(tensor)
    seconds = torch.tensor((datetime.datetime.now() - started).total_seconds() / iterations)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


MISTAKES = [
    ({"time_all_reduce": own_rank}, "each rank reports its own mean"),
    ({"time_all_reduce": fastest}, "the fastest rank's mean"),
    ({"time_all_reduce": no_warmup}, "untimed warm-up calls"),
    ({"time_all_reduce": mean_of_ranks}, "the mean over the ranks"),
    ({"time_all_reduce": total}, "divide by the iterations"),
    ({"time_all_reduce": warmup_timed}, "the warm-up calls were timed"),
    ({"time_all_reduce": datetime_clock}, "never read the check's clock"),
]
