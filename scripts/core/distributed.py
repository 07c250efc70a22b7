"""Where a process runs and who its peers are: device, backend, threads, process group.

The rules the course teaches, in one place:
- torchrun tells each process who it is through RANK, LOCAL_RANK, WORLD_SIZE and
  LOCAL_WORLD_SIZE; without them the script is one process of a world of one;
- a GPU process uses ``cuda:LOCAL_RANK`` (never the global RANK: node 2 has no
  GPU number 4) and calls ``torch.cuda.set_device`` before ``init_process_group``;
- NCCL goes with CUDA, gloo with the CPU;
- each process gets a deliberate share of the CPU cores.
"""
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import CourseError


@dataclass
class Runtime:
    """What a process knows about itself once set up."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: no process group (one process, no collectives)
    threads: int

    @property
    def is_main(self):
        """Rank 0 alone prints, writes records and saves checkpoints."""
        return self.rank == 0


def launched_by_torchrun():
    return "RANK" in os.environ


def process_layout():
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables."""
    env = os.environ
    return (
        int(env.get("RANK", 0)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        int(env.get("LOCAL_WORLD_SIZE", 1)),
    )


def usable_cpus():
    """Cores this process may run on, capped by what the scheduler granted the job."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for granted in ("NCPUS", "SLURM_CPUS_ON_NODE"):  # PBS, Slurm
        if os.environ.get(granted, "").isdigit():
            cores = min(cores, int(os.environ[granted]))
    return max(1, cores)


def pick_device(requested, local_rank, local_world_size):
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CourseError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    gpus = torch.cuda.device_count()
    if local_world_size > gpus:
        raise CourseError(
            f"{local_world_size} processes on this node but only {gpus} GPU(s); "
            f"launch with --nproc-per-node={gpus} or use --device cpu"
        )
    return torch.device("cuda", local_rank)


def pick_backend(requested, device):
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise CourseError("the nccl backend needs CUDA GPUs; use --backend gloo (or --backend auto)")
    return requested


def setup(args, process_group):
    """Choose device and threads, seed, and (when ``process_group``) join the process group.

    Every rank seeds the same before the model is built, so all ranks start from the
    same weights; ``reseed_for_training`` then gives each rank its own dropout stream.
    """
    rank, local_rank, world_size, local_world_size = process_layout()
    if not process_group and world_size > 1:
        raise CourseError("this script runs a single process; start it with python, not torchrun --nproc-per-node>1")
    device = pick_device(args.device, local_rank, local_world_size)
    threads = args.threads or max(1, usable_cpus() // local_world_size)
    torch.set_num_threads(threads)  # torchrun sets OMP_NUM_THREADS=1 unless told otherwise
    backend = None
    if process_group:
        backend = pick_backend(args.backend, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before init, so NCCL and all_gather_object use this GPU
        init_process_group(backend, rank, world_size, args.timeout)
    runtime = Runtime(rank, local_rank, world_size, local_world_size, device, backend, threads)
    if runtime.is_main:
        print(
            f"device {device}, backend {backend or 'none'}, world size {world_size}, "
            f"{threads} CPU thread(s) per process",
            flush=True,
        )
    if process_group:
        preflight(runtime)
    torch.manual_seed(args.seed)
    return runtime


def reseed_for_training(seed, runtime):
    """After the model is built: a different random stream per rank (dropout masks)."""
    torch.manual_seed(seed + runtime.rank)


def init_process_group(backend, rank, world_size, timeout_seconds):
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if launched_by_torchrun():
        # torchrun set MASTER_ADDR and MASTER_PORT; the env:// default reads them.
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        # Plain `python script.py`: a world of one, with an in-memory store (no port).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def preflight(runtime):
    """One all_reduce across every rank, then rank 0 prints the world it sees.

    A wrong node list or a blocked network shows here, in the first seconds of a
    job, instead of as a hang in the first training step.
    """
    ones = torch.ones(1, device=runtime.device)
    try:
        dist.all_reduce(ones)
        hosts = gather_from_all_ranks(socket.gethostname())
    except (RuntimeError, dist.DistBackendError) as error:
        raise CourseError(f"pre-flight all_reduce failed on rank {runtime.rank}: {first_line(error)}") from None
    if int(ones.item()) != runtime.world_size:
        raise CourseError(f"pre-flight all_reduce summed to {int(ones.item())}, expected {runtime.world_size}")
    if runtime.is_main:
        print(f"pre-flight all_reduce ok: {describe_world(hosts)}", flush=True)


def gather_from_all_ranks(value):
    """Every rank's ``value`` (any picklable object), as a list indexed by rank, on every rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def describe_world(hosts):
    """'4 ranks on 2 node(s): node-a [0-1], node-b [2-3]' from the host of each rank."""
    ranks_by_host = {}
    for rank, host in enumerate(hosts):
        ranks_by_host.setdefault(host, []).append(rank)
    nodes = ", ".join(f"{host} [{format_ranks(ranks)}]" for host, ranks in ranks_by_host.items())
    return f"{len(hosts)} rank(s) on {len(ranks_by_host)} node(s): {nodes}"


def format_ranks(ranks):
    """[0, 1, 2] -> '0-2'; ranks that are not consecutive are listed one by one."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def unwrap(model):
    """The plain model inside a DataParallel or DistributedDataParallel wrapper."""
    return getattr(model, "module", model)


def largest_difference_from_rank0(tensors):
    """How far this rank's tensors are from rank 0's, as the maximum over every rank.

    0.0 means every replica holds exactly rank 0's values: the check that data-parallel
    replicas are still in sync. A collective: every rank must call it.
    """
    mine = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    largest = (mine - rank0).abs().max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def barrier(runtime):
    if runtime.backend is not None:
        dist.barrier()


def save_checkpoint(model, path, runtime):
    """Rank 0 saves the unwrapped weights (no ``module.`` prefix); the others wait for it."""
    if runtime.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(unwrap(model).state_dict(), path)
        print(f"saved {path.name}", flush=True)
    barrier(runtime)


def load_checkpoint(model, path, device):
    """Load onto this process's own device, never onto the GPU that saved it."""
    state = torch.load(path, map_location=device, weights_only=True)
    unwrap(model).load_state_dict(state)


def teardown():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
