"""What can be wrong with how a process was started, said in one line. Kit: a learner may skip this module.

- torchrun's variables: all of them or none, whole numbers, consistent with each other; without any, a
  plain ``python`` run gets what torchrun would set for one process;
- GPUs: as many on the node as processes, each of an architecture this torch build has kernels for;
- gloo's network interfaces: ``GLOO_SOCKET_IFNAME`` must name interfaces of this host;
- where the ranks landed: the pre-flight line ``describe_world`` writes;
- when the ranks start: seconds apart; where they share torchrun's store and it restarts nothing, they meet
  before init_process_group (``wait_for_every_rank``), so that a few seconds of ``--timeout`` count from a
  common start;
- torchrun's restarts: torch 2.14 keeps one store for every attempt of a worker group; a restarted
  worker moves its attempt onto a store of its own (``meet_on_a_fresh_store``).
"""
import contextlib
import os
import socket
import time

import torch
import torch.distributed as dist

from .errors import CourseError, first_line

# Imported here, before any process group exists. torch/distributed/nn/functional.py gives its collectives the
# default argument group=group.WORLD, which Python evaluates when the module is first imported; torch._dynamo
# imports it, and a course script imports torch._dynamo after init_process_group (DDP's constructor, the optimizer
# and torchvision each do). Imported then, it would hold the default group to the end of the process, and gloo's
# threads would run into the interpreter's shutdown (tests/test_teardown.py says why that matters). Imported
# first, its defaults are None. (torch.distributed.optim's ZeroRedundancyOptimizer module does the same at import:
# demos/beyond_ddp.py imports it before its group starts.)
if dist.is_available():
    import torch.distributed.nn  # noqa: F401

# What torchrun sets for every worker it starts.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun(env=None):
    env = os.environ if env is None else env
    return any(name in env for name in TORCHRUN_VARIABLES)


def check_torchrun_variables(env):
    """Some but not all of torchrun's variables, or values that cannot be: an error that says so, before
    anything waits on a rendezvous that will never complete."""
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


def check_gpus(local_world_size):
    """A GPU for each process on this node."""
    if not torch.cuda.is_available():
        raise CourseError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    gpus = torch.cuda.device_count()
    if local_world_size > gpus:
        raise CourseError(
            f"{local_world_size} processes on this node but only {gpus} GPU(s); "
            f"launch with --nproc-per-node={gpus} or use --device cpu"
        )
    check_gpu_architecture()


# The route for GPUs the pinned CUDA 13 wheels have no kernels for (Volta and older): the README's
# "Which CUDA build" section. PyTorch's CUDA 12.6 wheels for x86-64 are built for sm_50 to sm_90, Volta's
# sm_70 among them (PYTORCH_RELEASES_CODE_CC in torch/cuda/__init__.py).
CUDA_12_ROUTE = ('install a CUDA 12 build of the same release, as the README says under "Which CUDA build": '
                 "pip install torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu126")


def has_kernels_for(capability, arch_list):
    """True when a torch built for ``arch_list`` (torch.cuda.get_arch_list(): 'sm_80', 'compute_90', ...) can
    run on a GPU of compute capability ``capability`` (major, minor).

    NVIDIA's rule for discrete GPUs (CUDA C++ Programming Guide, "Binary Compatibility"): machine code for
    sm_XY runs on X.Z with Z >= Y, the same major version only; PTX (compute_XY) is compiled when it is loaded,
    for XY and anything newer. torch itself only warns at its first CUDA call (torch.cuda._check_capability).
    """
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        number = int(number.rstrip("af"))  # sm_90a, sm_100f: the same major and minor
        built = divmod(number, 10)
        if kind == "sm" and built[0] == major and built[1] <= minor:
            return True
        if kind == "compute" and built <= (major, minor):
            return True
    return False


def gpus_without_kernels():
    """[(index, name, "X.Y")] for each visible GPU this torch build has no kernels for."""
    if not torch.cuda.is_available():
        return []
    arch_list = torch.cuda.get_arch_list()
    missing = []
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        if arch_list and not has_kernels_for(capability, arch_list):
            missing.append((index, torch.cuda.get_device_name(index), "{}.{}".format(*capability)))
    return missing


def architecture_problem(index, name, capability):
    """The one line that says a GPU has no kernels in this build, and the way out."""
    return (f"GPU {index} ({name}) has compute capability {capability}, and this torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}) has kernels only for {', '.join(torch.cuda.get_arch_list())}; "
            f"{CUDA_12_ROUTE}")


def check_gpu_architecture():
    """Before training: a GPU without kernels in this build fails in one line, not in the first kernel launch."""
    missing = gpus_without_kernels()
    if missing:
        raise CourseError(architecture_problem(*missing[0]))


def check_gloo_interfaces():
    """GLOO_SOCKET_IFNAME must name interfaces of this host; gloo itself ends in a C++ traceback."""
    wanted = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    present = {name for _, name in socket.if_nameindex()}
    missing = [name for name in wanted if name not in present]
    if missing:
        raise CourseError(f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} names no interface of this host "
                          f"({', '.join(missing)}); set it to one of: {', '.join(sorted(present))} "
                          f"(`ip -br addr` shows them), or unset it")


def use_world_of_one():
    """Plain ``python script.py``: set what torchrun would set for a single process, so that
    ``dist.init_process_group`` reads the same variables either way. Port 0: the only rank's store binds a
    port the OS picks at that moment, so no other process can take it between choosing and binding."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


@contextlib.contextmanager
def reserved_port():
    """A loopback port for a rendezvous that several processes must be told in advance, held until the block
    ends: bound with SO_REUSEADDR and no listen(). While it is bound, the OS hands the port to no other bind(0)
    or outgoing connection, so nothing can take it before the rendezvous store binds it; the store, which also
    sets SO_REUSEADDR, can bind it and listen because this socket does not listen. Until then, a connection to
    it is refused: nobody answers there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


def describe_world(hosts):
    """'4 rank(s) on 2 node(s): node-a [0-1], node-b [2-3]' from the host of each rank."""
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


def first_attempt():
    """True unless torchrun restarted this worker group (TORCHELASTIC_RESTART_COUNT > 0)."""
    return restart_count() == 0


def restart_count():
    """How many times torchrun has restarted this worker group (0 in its first attempt, and without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def meet_before_init(timeout, stop_signal):
    """What cli.run does before a script's main, so before init_process_group: the ranks of a group that
    torchrun restarts nothing meet (``wait_for_every_rank``); a restarted group moves onto a store of its own
    (``meet_on_a_fresh_store``)."""
    wait_for_every_rank(timeout, stop_signal)
    meet_on_a_fresh_store(timeout)


# Ranks start seconds apart: each imports torch, and a busy node or a shared file system slows some more
# than others. init_process_group waits for the others only as long as its timeout, so a drill that gives
# its collectives a few seconds (--timeout 3) would fail in init, before the drill, when a rank starts late.
START_WAIT_S = 300


def wait_for_every_rank(timeout, stop_signal=lambda: None):
    """Before init_process_group, meet every rank on torchrun's agent store (MASTER_ADDR:MASTER_PORT),
    waiting up to the larger of ``timeout`` and START_WAIT_S seconds: init's timeout then counts from a
    common start. Only where the workers share the agent's store (TORCHELASTIC_USE_AGENT_STORE=True: always
    with the static rendezvous, with c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and torchrun restarts
    nothing (--max-restarts 0): then every rank's agent counts 0 restarts and every rank meets. The keys
    name the world size: a group that torchrun re-forms (a node joined; without restarts the world only
    grows) meets on keys of its new size. A rank stops with one line when ``stop_signal()`` names a signal,
    when the store goes away, or when some rank never comes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("TORCHELASTIC_MAX_RESTARTS") != "0":
        return
    world_size, rank = int(os.environ["WORLD_SIZE"]), os.environ["RANK"]
    if world_size == 1:
        return
    import datetime

    address, port, wait = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], max(timeout, START_WAIT_S)
    meeting = f"course/{world_size}-ranks-started"
    count = f"{meeting}/count"
    try:  # the client gives up connecting after --timeout, as init's own would
        agent_store = dist.TCPStore(address, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
        agent_store.add(count, 1)
        agent_store.set(f"{meeting}/rank-{rank}", "here")  # after the count: a rank not counted is never here
        deadline = time.monotonic() + wait
        while agent_store.add(count, 0) < world_size:
            if stop_signal():
                raise CourseError(f"rank {rank}: {stop_signal()} came while it waited for the other ranks to start")
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if not agent_store.check([f"{meeting}/rank-{r}"])]
                raise CourseError(f"rank {rank}: rank(s) {format_ranks(missing)} of {world_size} did not start "
                                  f"within {wait} s; their log, or their node's, says why")
            time.sleep(0.1)  # a signal's handler runs here; in a store's own wait it would run only after it
    except RuntimeError as error:  # DistNetworkError, DistStoreError: the agent's store is gone or out of reach
        raise CourseError(f"rank {rank} lost, or could not reach, torchrun's store at {address}:{port} while waiting "
                          f"for the other ranks to start ({first_line(error)}); the log of the node that hosts it says "
                          f"why") from None


# torch 2.14's torchrun keeps one key-value store for every attempt of a worker group (its agent's,
# at MASTER_ADDR:MASTER_PORT, unless c10d rendezvous runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and
# init_process_group writes the same keys into it in every attempt. A restarted group can then read a dead
# peer's address left by the attempt before, and fail to connect or hang (pytorch/pytorch#167288, #135712). The
# course's launchers set the variable, which gives each attempt a store of its own; a plain torchrun
# line does not, so a restarted worker makes itself one (``meet_on_a_fresh_store``).
FRESH_STORE_PER_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STALE_STORE_HINT = ("a worker group restarted by torchrun could not connect to its peers: torchrun reused the store of "
                    "the failed attempt (pytorch/pytorch#167288); "
                    "run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set, as the course's launchers do")
_FRESH_STORE = []  # rank 0's store for this attempt, kept alive for init_process_group to reuse


def meet_on_a_fresh_store(timeout):
    """In a worker group that torchrun restarted on its agent's store, move this attempt onto a store of its
    own, before init_process_group: rank 0 starts one on a free port of its host (MASTER_ADDR) and posts the
    port in the agent's store under a key of this attempt (its restart count, which no earlier attempt used);
    every rank then points MASTER_PORT at it. init_process_group reads MASTER_PORT as usual, and rank 0's
    call takes over the store already listening there (multi_tenant). No effect in a first attempt, without
    torchrun, or with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. A rank that finds no port within ``timeout``
    seconds (plain torchrun over several nodes, whose agents may count restarts differently) stops with
    the one-line fix."""
    if first_attempt() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or _FRESH_STORE:
        return
    import datetime

    address, agent_port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    wait = datetime.timedelta(seconds=timeout)
    key = f"course/attempt-{restart_count()}/store-port"
    try:
        agent_store = dist.TCPStore(address, agent_port, is_master=False, timeout=wait)
        if rank == 0:
            fresh = dist.TCPStore(address, 0, int(os.environ["WORLD_SIZE"]), is_master=True, timeout=wait,
                                  wait_for_workers=False, multi_tenant=True)
            _FRESH_STORE.append(fresh)
            agent_store.set(key, str(fresh.port))
            port = fresh.port
        else:
            port = int(agent_store.get(key))  # waits for rank 0, up to the timeout
    except RuntimeError as error:  # DistStoreError: nothing posted within the timeout, or no agent store
        raise CourseError(f"rank {rank} of a worker group that torchrun restarted found no store of this attempt "
                          f"within {timeout} s ({first_line(error)}); run torchrun with "
                          f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set, as the course's launchers do "
                          f"(pytorch/pytorch#167288)") from None
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")


def is_stale_restart_store(error):
    """The symptom of that bug: a restarted group whose first connection is refused."""
    restarted = not first_attempt()
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return restarted and shared and "connectFullMesh" in str(error) or (
        restarted and shared and "Connection refused" in str(error) and not dist.is_initialized())
