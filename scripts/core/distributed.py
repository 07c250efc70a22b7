"""Who a process is, where it runs, and how the ranks agree, fail and report together.

The rules the course teaches, in one place:
- torchrun tells each process who it is through RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; without any of them a script is one
  process of a world of one;
- a GPU process uses ``cuda:LOCAL_RANK`` (never the global RANK: node 2 has no GPU
  number 4) and calls ``torch.cuda.set_device`` before ``init_process_group``;
- NCCL goes with CUDA, gloo with the CPU;
- each process gets a deliberate share of the CPU cores;
- a check that can fail on one rank only (data missing on one node, say) is agreed by
  every rank, so all of them stop with the same message instead of the healthy ones
  waiting for the whole ``--timeout``.

The step scripts call ``torch.cuda.set_device``, ``dist.init_process_group`` and
``dist.destroy_process_group`` themselves: those calls are the lesson. The demos use
``setup``, which does the same in one call.
"""
import atexit
import datetime
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import CourseError

# What torchrun sets for every worker it starts.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def launched_by_torchrun(env=None):
    env = os.environ if env is None else env
    return any(name in env for name in TORCHRUN_VARIABLES)


def process_layout(env=None):
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables, checked.

    None of them set: a world of one. Some but not all: an error that names what is
    missing, before anything waits on a rendezvous that will never complete.
    """
    env = os.environ if env is None else env
    if not launched_by_torchrun(env):
        return 0, 0, 1, 1
    present = [name for name in TORCHRUN_VARIABLES if name in env]
    missing = [name for name in TORCHRUN_VARIABLES if name not in env]
    if missing:
        raise CourseError(
            f"{', '.join(present)} set but not {', '.join(missing)}: start the script with torchrun, which sets "
            f"all of them, or unset {', '.join(present)} to run a single process"
        )
    try:
        rank, local_rank, world_size, local_world_size = (
            int(env[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    except ValueError:
        raise CourseError("RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE must be whole numbers; "
                          "start the script with torchrun, which sets them") from None
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        raise CourseError(
            f"inconsistent torchrun variables: RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={world_size} "
            f"LOCAL_WORLD_SIZE={local_world_size} (need 0 <= RANK < WORLD_SIZE and LOCAL_RANK < LOCAL_WORLD_SIZE "
            f"<= WORLD_SIZE); start the script with torchrun instead of setting them by hand"
        )
    return rank, local_rank, world_size, local_world_size


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


def this_process(args, single_process=False):
    """Who this process is and where it runs: rank, device, backend, threads. No collectives yet.

    ``single_process``: the script trains in one process (the baseline, DataParallel)
    and refuses to be started several times by torchrun.
    """
    rank, local_rank, world_size, local_world_size = process_layout()
    if single_process and world_size > 1:
        raise CourseError("this script runs a single process; start it with python, not torchrun --nproc-per-node>1")
    if not launched_by_torchrun() and not single_process:
        use_world_of_one()
    device = pick_device(args.device, local_rank, local_world_size)
    backend = None if single_process else pick_backend(args.backend, device)
    if backend == "gloo":
        check_gloo_interfaces()
    threads = args.threads or max(1, usable_cpus() // local_world_size)
    torch.set_num_threads(threads)  # torchrun sets OMP_NUM_THREADS=1 unless told otherwise
    runtime = Runtime(rank, local_rank, world_size, local_world_size, device, backend, threads,
                      datetime.timedelta(seconds=args.timeout))
    if runtime.is_main:
        print(f"device {device}, backend {backend or 'none'}, world size {world_size}, "
              f"{threads} CPU thread(s) per process", flush=True)
    return runtime


def check_gloo_interfaces():
    """GLOO_SOCKET_IFNAME must name interfaces of this host; gloo itself ends in a C++ traceback."""
    wanted = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    present = {name for _, name in socket.if_nameindex()}
    missing = [name for name in wanted if name not in present]
    if missing:
        raise CourseError(f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} names no interface of this host "
                          f"({', '.join(missing)}); set it to one of: {', '.join(sorted(present))} "
                          f"(`ip -br addr` shows them), or unset it")


def leave_together():
    """The end of a demo: every rank waits for the others (none closes its connections while a
    peer still needs them), then tears the process group down, which joins gloo's worker threads
    when nothing else holds the group (tests/test_teardown.py checks the scripts).
    Left running into Python's shutdown, one of them can free a tensor then and abort the process
    ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def use_world_of_one():
    """Plain ``python script.py``: set what torchrun would set for a single process, so
    that ``dist.init_process_group`` reads the same variables either way."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup(args, process_group=True):
    """Everything a demo needs in one call: this process, set_device, init and pre-flight.
    The step scripts spell these calls out instead."""
    runtime = this_process(args, single_process=not process_group)
    if process_group:
        if runtime.device.type == "cuda":
            torch.cuda.set_device(runtime.device)
        dist.init_process_group(runtime.backend, timeout=runtime.timeout)
        preflight(runtime)
    torch.manual_seed(args.seed)
    return runtime


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
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@contextmanager
def fail_together(runtime):
    """Run a check on every rank; if it fails on any of them, every rank raises the same error.

        with fail_together(runtime):
            train_set, test_set = load_datasets(...)

    Without this, the rank whose check failed exits, and the others wait in their
    next collective for the whole --timeout before they learn anything.
    """
    problem = None
    try:
        yield
    except CourseError as error:
        problem = str(error)
    except OSError as error:
        problem = f"{error.strerror or error}: {error.filename}" if error.filename else str(error)
    problems = gather_from_all_ranks((problem, socket.gethostname()))
    failed = [(rank, text, host) for rank, (text, host) in enumerate(problems) if text]
    if failed:
        rank, text, host = failed[0]
        where = f"rank {rank} ({host}): " if len(problems) > 1 else ""
        others = f" [and on {len(failed) - 1} more rank(s)]" if len(failed) > 1 else ""
        raise CourseError(f"{where}{text}{others}")


def agree(value, view, fix):
    """Every rank must hold the same ``value``; if any differs from rank 0's, every rank raises the same error.

    For what each rank finds on its own and may find differently (files on its own node's disk, say),
    where no rank alone is wrong but the ranks must not go on apart. ``view`` says in words what this rank
    found; the error names the first rank that differs and rank 0, with their views, then ``fix``:

        rank 1 (node-b) sees no checkpoint in ... while rank 0 (node-a) resumes from ...: <fix>
    """
    views = gather_from_all_ranks((value, view, socket.gethostname()))
    differ = [rank for rank, (theirs, _, _) in enumerate(views) if theirs != views[0][0]]
    if differ:
        rank = differ[0]
        others = f" [and {len(differ) - 1} more rank(s)]" if len(differ) > 1 else ""
        raise CourseError(f"rank {rank} ({views[rank][2]}) {views[rank][1]} while rank 0 ({views[0][2]}) "
                          f"{views[0][1]}{others}: {fix}")


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
    if runtime.distributed:
        dist.barrier()


def teardown():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- who fell behind

class Progress:
    """Where each rank is, posted to the job's key-value store, so that a rank whose collective fails can say
    which rank fell behind or died, instead of only "timed out".

    A rank's position is the steps it has completed and what it has done since: a phase of ``PHASES``, in the
    order a step goes through them (the waiter of a collective in step N+1 is "training" after N steps; a rank
    that stopped after step N is still "between steps"). Any rank whose position is behind the waiter's never
    reached the collective the waiter is stuck in.

    ``post`` only notes the position in memory: a training step pays an assignment for it. A thread writes it
    to the store whenever it has changed, at most every ``INTERVAL`` seconds, whatever the main thread is doing
    (computing, waiting in a collective, asleep). So a rank that stopped anywhere has its true position in the
    store within ``INTERVAL``, long before any --timeout ends the wait, however long a step takes. The store is
    the one every rank already shares: torchrun's, at MASTER_ADDR:MASTER_PORT.
    """

    INTERVAL = 0.25  # seconds between writes at most: a few tiny writes a second, far below any --timeout
    PHASES = ("starting", "between steps", "ending the epoch", "training", "finished")

    def __init__(self, runtime):
        self.runtime = runtime
        self.store = None
        self.position = (0, "starting", time.time())  # steps done, phase, since when
        self.written = None
        self.lock = threading.Lock()  # one connection to the store, shared by the writer thread and explain
        self.stopped = threading.Event()
        self.writer = None
        if runtime.world_size > 1:
            try:
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=datetime.timedelta(seconds=10))
            except (RuntimeError, KeyError, ValueError):
                self.store = None  # diagnosis only: training does not depend on it
        if self.store is not None:
            self.writer = threading.Thread(target=self.keep_writing, name="course-progress", daemon=True)
            self.writer.start()
            atexit.register(self.close)  # stopped before the interpreter shuts down, never in the middle of a write

    @staticmethod
    def key(rank):
        return f"course/progress/{rank}"

    def post(self, step, phase, now=False):
        """This rank has completed ``step`` steps and is ``phase`` (one of PHASES) since.

        ``now``: write it to the store before returning (at the start and the end), instead of within INTERVAL.
        """
        if (step, phase) != self.position[:2]:
            self.position = (step, phase, time.time())
        if now:
            self.write()

    def write(self):
        """Write this rank's position to the store, if it changed since the last write."""
        with self.lock:
            position = self.position
            if self.store is None or position == self.written:
                return
            step, phase, since = position
            try:
                self.store.set(self.key(self.runtime.rank), f"{step} {since:.3f} {phase}")
                self.written = position
            except RuntimeError:
                self.store = None  # the store is gone: the job is ending

    def keep_writing(self):
        while not self.stopped.wait(self.INTERVAL) and self.store is not None:
            self.write()

    def close(self):
        """Stop the writer thread (its last change written first)."""
        if self.writer is not None and not self.stopped.is_set():
            self.stopped.set()
            self.writer.join(timeout=2 * self.INTERVAL)
            self.write()

    def others(self):
        """[(rank, steps done, seconds in its phase, phase)] of every other rank, where known."""
        seen = []
        with self.lock:
            if self.store is None:
                return []
            for rank in range(self.runtime.world_size):
                if rank == self.runtime.rank:
                    continue
                try:
                    if not self.store.check([self.key(rank)]):
                        seen.append((rank, None, None, "never reported"))
                        continue
                    step, since, phase = self.store.get(self.key(rank)).decode().split(" ", 2)
                    seen.append((rank, int(step), time.time() - float(since), phase))
                except (RuntimeError, ValueError):
                    return seen  # the store itself is gone: the job is ending
        return seen

    def behind(self, step, phase):
        """True when a rank at (step, phase) cannot have reached the collective this rank waits in.
        A finished rank joins no collective any more; a phase this code does not know is reported too."""
        mine = (self.position[0], self.PHASES.index(self.position[1]))
        if phase == "finished" or phase not in self.PHASES:
            return True
        return (step, self.PHASES.index(phase)) < mine

    def explain_collective_failure(self, error, step):
        """One line: what happened to this rank's collective at ``step``, and who seems to be behind."""
        text = first_line(error)
        if "Timed out" in text or "timeout" in text.lower():
            what = f"waited longer than --timeout {self.runtime.timeout.total_seconds():.0f} s in a collective"
        else:
            what = f"lost a peer in a collective ({text})"
        laggards = [f"rank {rank} last reported step {s} {age:.0f} s ago ({phase})" if s is not None
                    else f"rank {rank} {phase}"
                    for rank, s, age, phase in self.others() if s is None or self.behind(s, phase)]
        who = "; ".join(laggards) if laggards else "the other ranks' progress is unknown; their logs say why"
        return (f"rank {self.runtime.rank} {what} at step {step}: {who}. A stalled or dead rank stops every rank; "
                f"look at its log first")


def is_collective_failure(error):
    """True for the errors a collective raises when a peer stalls or dies (gloo and NCCL)."""
    if isinstance(error, dist.DistBackendError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("Timed out", "Connection closed by peer", "Connection reset by peer",
                                      "Socket Timeout"))


# torch 2.14's torchrun keeps one key-value store for every attempt of a worker group, so
# after a restart a worker can read a dead peer's address left by the attempt before and
# fail to connect (pytorch/pytorch#167288). With this variable set for torchrun, each
# attempt gets a fresh store. The course's launchers set it; by hand:
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=3 ...
FRESH_STORE_PER_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STALE_STORE_HINT = ("a worker group restarted by torchrun could not connect to its peers: torchrun reused the store of "
                    "the failed attempt (pytorch/pytorch#167288); run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                    "set, as the course's launchers do")


def is_stale_restart_store(error):
    """The symptom of that bug: a restarted group whose first connection is refused."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return restarted and shared and "connectFullMesh" in str(error) or (
        restarted and shared and "Connection refused" in str(error) and not dist.is_initialized())
