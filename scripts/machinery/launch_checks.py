"""What can be wrong with how a process was started, said in one line. Machinery: a learner may skip this module.

- torchrun's variables: all of them or none, whole numbers, consistent with each other; without any, a
  plain ``python`` run gets what torchrun would set for one process;
- GPUs: as many on the node as processes;
- gloo's network interfaces: ``GLOO_SOCKET_IFNAME`` must name interfaces of this host;
- where the ranks landed: the pre-flight line ``describe_world`` writes;
- torchrun's restarts: torch 2.14 keeps one store for every attempt of a worker group.
"""
import os
import socket

import torch
import torch.distributed as dist

from .errors import CourseError

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


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


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
    restarted = not first_attempt()
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return restarted and shared and "connectFullMesh" in str(error) or (
        restarted and shared and "Connection refused" in str(error) and not dist.is_initialized())
