#!/usr/bin/env python3
"""Start one torchrun on this node, with arguments read from the batch scheduler.

    python scripts/launch.py [--dry-run] [--nproc-per-node N] [--port P] SCRIPT [SCRIPT_ARGS...]

Run it once per node of a job (PBS: `pbsdsh` in job_scripts/04_ddp_2nodes.pbs;
Slurm: `srun --ntasks-per-node=1` in job_scripts/*.sbatch). It reads:

  PBS    PBS_NODEFILE (one line per chunk or cpu; duplicates are dropped, order kept),
         PBS_JOBID, PBS_NODENUM (set by pbsdsh), NGPUS, NCPUS
  Slurm  SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, SLURM_JOB_ID, SLURM_NODEID,
         SLURM_GPUS_ON_NODE, SLURM_CPUS_ON_NODE
  none   a single-node run on this machine

and derives what torchrun needs:

  nnodes          the number of distinct hosts
  node rank       PBS_NODENUM / SLURM_NODEID, else this host's place in the list
  nproc-per-node  --nproc-per-node, else the GPUs the job got (NGPUS / SLURM_GPUS_ON_NODE,
                  else the GPUs torch sees), else on a CPU node min(CPUs, 4)
  rendezvous      c10d on the first host, at a port computed from the job id (every node
                  computes the same one; two jobs sharing a node get different ones),
                  rdzv-id = the job id; the first host is told explicitly to host the store
  one node        torchrun --standalone (a free port is picked by torchrun itself)

then replaces itself with `python -m torch.distributed.run ...`. --dry-run prints that
command instead. Everything else (restarts, worker environment, RANK/LOCAL_RANK, ...)
is torchrun's job.

The training scripts check the world before training: right after
init_process_group, one all_reduce across every rank, and rank 0 prints
"pre-flight all_reduce ok: 4 rank(s) on 2 node(s): ...". A wrong node list or a
blocked network fails there, in seconds, with a one-line error.
"""
import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import zlib
from dataclasses import dataclass

# Rendezvous ports are 20000-29999: below Linux's ephemeral range (32768-60999), so a
# port the kernel hands out for an outgoing connection does not collide with ours.
PORT_BASE = 20000
PORT_SPAN = 10000

# On a CPU node, at most this many processes per node. Each process is a full model
# replica; past a few, the extra gloo all_reduce traffic and memory outweigh the gain
# for the course's small model, and torch's own intra-op threads already use the cores
# (the training scripts give each process CPUs // processes threads).
CPU_PROCS_CAP = 4

# Seconds torchrun waits for every node to join the rendezvous before giving up
# (torch's default is 600). Nodes of one job start within seconds of each other.
DEFAULT_JOIN_TIMEOUT = 300


class LaunchError(Exception):
    """A problem with the job's environment or the arguments: one line for the user."""


@dataclass
class Plan:
    scheduler: str  # "pbs", "slurm" or "none"
    job_id: str | None
    hosts: list
    node_rank: int
    nproc_per_node: int
    nproc_reason: str
    port: int | None  # None for a single-node (standalone) run

    @property
    def nnodes(self):
        return len(self.hosts)

    @property
    def rdzv_id(self):
        return f"{self.scheduler}-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.job_id)}"

    @property
    def endpoint(self):
        return f"{self.hosts[0]}:{self.port}"


# ---------------------------------------------------------------- reading the environment

def detect_scheduler(env):
    if env.get("PBS_JOBID") or env.get("PBS_NODEFILE"):
        return "pbs"
    if env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"):
        return "slurm"
    return "none"


def unique_in_order(names):
    seen = set()
    return [name for name in names if not (name in seen or seen.add(name))]


def read_nodefile(path):
    """Distinct hosts of a PBS node file, in order (PBS repeats a host per chunk or cpu)."""
    if not path:
        raise LaunchError("PBS_NODEFILE is not set; run this inside a PBS job (qsub), or unset PBS_JOBID to run on this machine alone")
    try:
        with open(path) as file:
            lines = [line.strip() for line in file]
    except OSError as error:
        raise LaunchError(f"cannot read PBS_NODEFILE={path} ({error.strerror}); inside a PBS job it names the job's hosts") from None
    hosts = unique_in_order(line for line in lines if line and not line.startswith("#"))
    if not hosts:
        raise LaunchError(f"PBS_NODEFILE={path} is empty; it should list the job's hosts, one per line")
    return hosts


def expand_hostlist(text):
    """Expand a Slurm host list such as 'gpu[01-03,07],login1' into host names.

    Used only where `scontrol show hostnames` is not available (a laptop, a unit test):
    scontrol is the authority and is present on every Slurm node.
    """
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    hosts = []
    for item in filter(None, (item.strip() for item in items)):
        hosts.extend(_expand_item(item))
    return hosts


def _expand_item(item):
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", item)
    if not match:
        if "[" in item or "]" in item:
            raise LaunchError(f"cannot read the Slurm host list entry {item!r}; is scontrol on PATH?")
        return [item]
    prefix, ranges, rest = match.groups()
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise LaunchError(f"cannot read the Slurm host list entry {item!r}; is scontrol on PATH?")
        for number in range(int(low), int(high or low) + 1):
            names.append(f"{prefix}{number:0{len(low)}d}")
    return [name + tail for name in names for tail in _expand_item(rest)] if rest else names


def slurm_hosts(nodelist):
    if shutil.which("scontrol"):
        try:
            result = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                                    capture_output=True, text=True, timeout=30)
            if result.returncode == 0 and result.stdout.split():
                return result.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_hostlist(nodelist)


def int_var(env, name):
    value = env.get(name, "").strip()
    if not value:
        return None
    # Slurm writes some counts as "2(x3)"; the first number is this node's.
    match = re.match(r"\d+", value)
    if not match:
        raise LaunchError(f"{name}={value!r} is not a number")
    return int(match.group())


def this_host_names():
    names = {socket.gethostname(), socket.getfqdn()}
    return names | {name.split(".")[0] for name in names}


def rank_by_hostname(hosts, source):
    mine = this_host_names()
    for rank, host in enumerate(hosts):
        if host in mine or host.split(".")[0] in mine:
            return rank
    raise LaunchError(
        f"this host ({socket.gethostname()}) is not in {source} ({', '.join(hosts)}); "
        "start the launcher on the job's nodes (pbsdsh / srun), which also sets the node number"
    )


def visible_gpus():
    """GPUs torch can see here (it honours CUDA_VISIBLE_DEVICES).

    Importing torch takes seconds, so it is skipped where the NVIDIA driver lists no GPU.
    """
    if not os.path.isdir("/proc/driver/nvidia/gpus") or not os.listdir("/proc/driver/nvidia/gpus"):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpus_here(env, scheduler_var):
    granted = int_var(env, scheduler_var) if scheduler_var else None
    if granted:
        return granted, f"{scheduler_var}={granted}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, f"{cores} cores"


def processes_per_node(env, scheduler, requested):
    if requested is not None:
        return requested, "--nproc-per-node"
    gpu_var = {"pbs": "NGPUS", "slurm": "SLURM_GPUS_ON_NODE"}.get(scheduler)
    gpus = int_var(env, gpu_var) if gpu_var else None
    if gpus:
        return gpus, f"one per GPU, {gpu_var}={gpus}"
    if gpus is None:  # the scheduler did not say; ask torch
        gpus = visible_gpus()
        if gpus:
            return gpus, f"one per visible GPU ({gpus})"
    cpus, where = cpus_here(env, {"pbs": "NCPUS", "slurm": "SLURM_CPUS_ON_NODE"}.get(scheduler))
    return max(1, min(cpus, CPU_PROCS_CAP)), f"no GPU: CPUs ({where}), at most {CPU_PROCS_CAP}"


def job_port(job_id):
    """The rendezvous port of a job: the same on every node, usually different between jobs."""
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def plan_from_env(env, nproc_per_node=None, port=None):
    scheduler = detect_scheduler(env)
    if scheduler == "pbs":
        job_id = env.get("PBS_JOBID") or "interactive"
        hosts = read_nodefile(env.get("PBS_NODEFILE"))
        node_rank = int_var(env, "PBS_NODENUM")
        source = "PBS_NODEFILE"
    elif scheduler == "slurm":
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("SLURM_JOB_NODELIST is not set; run this inside a Slurm job (sbatch/salloc + srun)")
        hosts = unique_in_order(slurm_hosts(nodelist))
        node_rank = int_var(env, "SLURM_NODEID")
        source = "SLURM_JOB_NODELIST"
        tasks, nodes = int_var(env, "SLURM_STEP_NUM_TASKS"), int_var(env, "SLURM_STEP_NUM_NODES")
        if tasks and nodes and tasks > nodes:
            raise LaunchError(f"srun started {tasks} launchers on {nodes} node(s); start one per node: srun --ntasks-per-node=1")
        if len(hosts) > 1 and not env.get("SLURM_STEP_ID"):
            raise LaunchError(f"this job has {len(hosts)} nodes; start the launcher on each with srun --ntasks-per-node=1")
    else:
        job_id, hosts, node_rank, source = None, [socket.gethostname()], 0, "this machine"

    if len(hosts) == 1:
        node_rank = 0
    elif node_rank is None:
        node_rank = rank_by_hostname(hosts, source)
    if node_rank >= len(hosts):
        raise LaunchError(
            f"this is node {node_rank} but {source} names only {len(hosts)} distinct host(s) ({', '.join(hosts)}); "
            "ask for one chunk per node (PBS: mpiprocs=1 and -l place=scatter)"
        )
    nproc, reason = processes_per_node(env, scheduler, nproc_per_node)
    if len(hosts) > 1:
        port = port if port is not None else job_port(job_id)
    return Plan(scheduler, job_id, hosts, node_rank, nproc, reason, port if len(hosts) > 1 else None)


# ---------------------------------------------------------------- the torchrun command

def torchrun_command(plan, script, script_args, join_timeout=DEFAULT_JOIN_TIMEOUT, python=sys.executable):
    command = [python, "-m", "torch.distributed.run"]
    if plan.nnodes == 1:
        command += ["--standalone", "--nnodes=1", f"--nproc-per-node={plan.nproc_per_node}"]
    else:
        # is_host: the first host of the list runs the rendezvous store. Said explicitly,
        # because torch's own guess compares host names and IPs and can miss (an alias,
        # a second network interface), and then no node, or two, would host it.
        is_host = 1 if plan.node_rank == 0 else 0
        command += [
            f"--nnodes={plan.nnodes}",
            f"--nproc-per-node={plan.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={plan.endpoint}",
            f"--rdzv-id={plan.rdzv_id}",
            f"--rdzv-conf=is_host={is_host},join_timeout={join_timeout}",
        ]
    return command + [script] + list(script_args)


def describe(plan):
    where = {"pbs": f"PBS job {plan.job_id}", "slurm": f"Slurm job {plan.job_id}", "none": "no scheduler"}[plan.scheduler]
    text = f"launch.py: {where}; node {plan.node_rank} of {plan.nnodes} ({', '.join(plan.hosts)}); "
    text += f"{plan.nproc_per_node} process(es) per node ({plan.nproc_reason}); "
    if plan.port is None:
        return text + "single node: torchrun --standalone"
    return text + f"rendezvous c10d at {plan.endpoint}, id {plan.rdzv_id}"


def check_resolves(host):
    """Every node connects to the first host by name: a name that does not resolve fails here."""
    try:
        socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as error:
        raise LaunchError(
            f"the rendezvous host {host} (first in the job's host list) does not resolve ({error}); "
            "check the node list, or ask your site how compute nodes name each other"
        ) from None


def check_port_free(port):
    """On the rendezvous host: fail now, clearly, rather than inside torchrun's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is fine
        try:
            probe.bind(("", port))
        except OSError as error:
            raise LaunchError(
                f"port {port} on {socket.gethostname()} is already in use ({error.strerror}), "
                "perhaps by another job on this node; pick another with --port"
            ) from None


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\nSee the module docstring for how each value is derived.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N", help="processes on this node (default: GPUs, else CPUs up to 4)")
    parser.add_argument("--port", type=int, default=None, metavar="P", help="rendezvous port on the first host (default: derived from the job id)")
    parser.add_argument("--join-timeout", type=int, default=DEFAULT_JOIN_TIMEOUT, metavar="S",
                        help=f"seconds to wait for every node to join (default {DEFAULT_JOIN_TIMEOUT})")
    parser.add_argument("script", help="the training script, e.g. scripts/train_ddp.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script unchanged")
    args = parser.parse_args(argv)
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be at least 1")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error("--port must be between 1 and 65535")
    if args.join_timeout < 1:
        parser.error("--join-timeout must be at least 1")
    return args


def main(argv=None, env=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    try:
        if not os.path.isfile(args.script):
            raise LaunchError(f"no such training script: {args.script} (run from the course directory, e.g. scripts/train_ddp.py)")
        plan = plan_from_env(env, args.nproc_per_node, args.port)
        command = torchrun_command(plan, args.script, args.script_args, args.join_timeout)
        print(describe(plan), file=sys.stderr, flush=True)
        if args.dry_run:
            print(shlex.join(command), flush=True)
            return 0
        if plan.port is not None:
            check_resolves(plan.hosts[0])
            if plan.node_rank == 0:
                check_port_free(plan.port)
    except LaunchError as error:
        print(f"launch.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    print(f"launch.py: exec {shlex.join(command)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(command[0], command)  # torchrun takes over this process: its exit status is the job's


if __name__ == "__main__":
    sys.exit(main())
