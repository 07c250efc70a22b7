"""Run a test's function in a real 2-process gloo group on 127.0.0.1.

The function must live in a module (not be defined inside a test), because the
worker processes import it by name: the same rule that stops ``mp.spawn`` from a notebook.
"""
import datetime

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)


def _worker(rank, world_size, port, function, args, results):
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        results[rank] = function(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_in_group(function, *args, world_size=2):
    """Call ``function(rank, world_size, *args)`` in each process; return the results by rank.

    The group's store is served from this process, on a port the OS picks as it binds it (port 0): no port
    is chosen first and bound later, so nothing else can take it in between."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(world_size, store.port, function, args, results),
                       nprocs=world_size, join=True, start_method="spawn")
    return [results[rank] for rank in range(world_size)]
