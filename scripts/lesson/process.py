"""Who a process is, where it runs, and the first collective every rank takes part in.

- torchrun tells each process who it is through RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT; without them a script is one process of a world of one;
- a GPU process uses ``cuda:LOCAL_RANK`` (never the global RANK: node 2 has no GPU number 4) and
  calls ``torch.cuda.set_device`` before ``init_process_group``;
- NCCL goes with CUDA, gloo with the CPU;
- each process gets a deliberate share of the CPU cores (torchrun sets OMP_NUM_THREADS=1).

The step scripts call ``set_device``, ``init_process_group`` and ``destroy_process_group`` themselves:
those calls are the lesson.
"""
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kit import launch_checks
from kit.agreement import gather_from_all_ranks
from kit.errors import CourseError, first_line


@dataclass
class Runtime:
    """What a process knows about itself before and after it joins the process group."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: a single-process script, no process group
    threads: int
    timeout: datetime.timedelta

    @property
    def is_main(self):
        """Rank 0 alone prints, writes records and saves checkpoints."""
        return self.rank == 0

    @property
    def distributed(self):
        """True once this process is in a process group (a world of one counts)."""
        return dist.is_available() and dist.is_initialized()


def process_layout(env=None):
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables; a world of one without them."""
    env = os.environ if env is None else env
    if not launch_checks.launched_by_torchrun(env):
        return 0, 0, 1, 1
    launch_checks.check_torchrun_variables(env)  # all of them, whole numbers, consistent: else one line
    return tuple(int(env[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))


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
    launch_checks.check_gpus(local_world_size)  # enough GPUs on this node: else one line that says how many
    return torch.device("cuda", local_rank)


def pick_backend(requested, device):
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise CourseError("the nccl backend needs CUDA GPUs; use --backend gloo (or --backend auto)")
    return requested


def this_process(args, single_process=False):
    """Who this process is and where it runs: rank, device, backend, threads. No collectives yet.

    ``single_process``: the script trains in one process (the baseline, DataParallel).
    """
    rank, local_rank, world_size, local_world_size = process_layout()
    if single_process and world_size > 1:
        raise CourseError("this script runs a single process; start it with python, not torchrun --nproc-per-node>1")
    if not launch_checks.launched_by_torchrun() and not single_process:
        launch_checks.use_world_of_one()  # plain python: what torchrun would set for one process
    device = pick_device(args.device, local_rank, local_world_size)
    backend = None if single_process else pick_backend(args.backend, device)
    if backend == "gloo":
        launch_checks.check_gloo_interfaces()
    threads = args.threads or max(1, usable_cpus() // local_world_size)
    torch.set_num_threads(threads)
    runtime = Runtime(rank, local_rank, world_size, local_world_size, device, backend, threads,
                      datetime.timedelta(seconds=args.timeout))
    if runtime.is_main:
        print(f"device {device}, backend {backend or 'none'}, world size {world_size}, "
              f"{threads} CPU thread(s) per process", flush=True)
    return runtime


def preflight(runtime):
    """One all_reduce across every rank, then rank 0 prints the world it sees.

    A wrong node list or a blocked network shows here, in the first seconds of a job,
    instead of as a hang in the first training step.
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
        print(f"pre-flight all_reduce ok: {launch_checks.describe_world(hosts)}", flush=True)
