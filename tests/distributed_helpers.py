"""Run a test's function in a real 2-process gloo group on 127.0.0.1.

The function must live in a module (not be defined inside a test), because the
worker processes import it by name: the same rule that stops ``mp.spawn`` from a notebook.
"""
import datetime

import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port


def _worker(rank, world_size, port, function, args, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results[rank] = function(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_in_group(function, *args, world_size=2):
    """Call ``function(rank, world_size, *args)`` in each process; return the results by rank."""
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(world_size, free_port(), function, args, results),
                       nprocs=world_size, join=True, start_method="spawn")
    return [results[rank] for rank in range(world_size)]
