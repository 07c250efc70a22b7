#!/usr/bin/env python3
"""Start one torchrun on this node, with arguments read from the batch scheduler.

    python scripts/tools/launch.py [--dry-run] [--nproc-per-node N] [--gpus-per-process K] [--max-restarts K]
                             [--port P] SCRIPT [ARGS...]
    python scripts/tools/launch.py --check-gpus     (the JupyterLab jobs: the GPU check alone)

Run it once per node of a job (PBS: `pbsdsh` in job_scripts/04_ddp_2nodes.pbs;
Slurm: `srun --ntasks-per-node=1` in job_scripts/*.sbatch). It derives what torchrun
needs from what the scheduler granted the job:

  hosts           PBS: the lines of PBS_NODEFILE, duplicates dropped, order kept.
                  Slurm: SLURM_STEP_NODELIST or SLURM_JOB_NODELIST. None: this machine.
  this node       this host's place in that list (Slurm: SLURM_NODEID). Under pbsdsh,
                  PBS_NODENUM must agree, and a host listed twice is an error: pbsdsh
                  would start two launchers there. It decides one thing: node 0 serves
                  the rendezvous store. It is not torchrun's node rank: the c10d
                  rendezvous numbers the nodes itself (GROUP_RANK), in the sorted order
                  of their host names, and MASTER_ADDR is the host of group rank 0.
  nproc-per-node  --nproc-per-node, else one process per GPU GRANTED on this node:
                  SLURM_GPUS_ON_NODE; CUDA_VISIBLE_DEVICES (set where the site isolates
                  GPUs); NGPUS (set by some PBS sites); the job's ngpus on this host (PBS:
                  exec_vnode in `qstat -f`). Never all the GPUs the node has: other jobs
                  may be using some. A job that was granted none, on a node with none:
                  one process per CPU granted (NCPUS, SLURM_CPUS_ON_NODE), at most 4.
                  --gpus-per-process K (a model that spans K GPUs per process, as in
                  step6_model_parallel.py): one process per K GPUs granted.
  GPUs unseen     GPUs the scheduler granted on this node that torch cannot see stop the
                  job here, on every node, in one line that names the likely cause: never
                  a silent run on CPUs. A site without GPUs whose jobs still ask for them allows the
                  fall-back in job_scripts/site.sh (COURSE_CPU_FALLBACK=yes): the same
                  processes then run on CPUs, and the log says so in one line.
  rendezvous      c10d on the first host, at a port computed from the job id (every node
                  computes the same one; two jobs sharing a node get different ones);
                  rdzv-id = the job id; the first host is told to host the store.
                  One node: torchrun --standalone (torchrun picks a free port).
  restarts        --max-restarts (default 3), torchrun's own: a failed worker group is
                  restarted, and resumes from its last checkpoint (the job scripts pass
                  --resume).
  signals         torchrun passes SIGTERM, SIGINT and SIGUSR1 on to its workers, which stop
                  after the same step with a checkpoint (--signals-to-handle).

then replaces itself with `python -m torch.distributed.run ...`. --dry-run prints what it
derived, and from where, and the command, without running it.

The training scripts check the world before training: right after
init_process_group, one all_reduce across every rank, and rank 0 prints
"pre-flight all_reduce ok: 4 rank(s) on 2 node(s): ...", each host with its ranks: the
placement torchrun chose. A wrong node list or a blocked network fails there, in seconds,
with a one-line error.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's kit

from kit.schedulers import pbs_command  # noqa: E402 (after the path)

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

# The signals torchrun passes on to its workers, which stop with a checkpoint on SIGTERM, SIGINT and
# SIGUSR1 (machinery/signals.py, graceful_stop.py): torchrun's own list (run.py, --signals-to-handle) and SIGUSR1,
# which a Slurm job's --signal=USR1@... (without B:) sends to every process of its steps. Without it,
# SIGUSR1 would end torchrun itself (its default action) and leave its workers behind.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"

# Where the NVIDIA driver lists the GPUs it drives: absent on a node without the driver.
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"

# job_scripts/site.sh's switch: "yes" lets a job granted GPUs that torch cannot see run on CPUs.
CPU_FALLBACK = "COURSE_CPU_FALLBACK"

# How often torchrun restarts a failed worker group (torch's default is 0). A job runs
# unattended: a worker killed once (the OOM killer, a flaky link, a pre-empted GPU)
# should cost the steps since the last checkpoint, not the job. A fault that repeats
# (bad input, a bug) fails every try, so a few tries bound what it wastes.
DEFAULT_MAX_RESTARTS = 3


class LaunchError(Exception):
    """A problem with the job's environment or the arguments: one line for the user."""


@dataclass
class Plan:
    scheduler: str  # "pbs", "slurm" or "none"
    job_id: str | None
    hosts: list
    hosts_source: str
    node_rank: int
    rank_source: str
    nproc_per_node: int
    nproc_source: str
    port: int | None  # None for a single-node (standalone) run
    max_restarts: int = DEFAULT_MAX_RESTARTS
    warnings: list = field(default_factory=list)

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
    """The lines of a PBS node file: one per chunk (mpiprocs=1) or per MPI rank."""
    if not path:
        raise LaunchError(
            "PBS_NODEFILE is not set; run this inside a PBS job (qsub), or unset PBS_JOBID to run on this machine alone"
        )
    try:
        with open(path) as file:
            lines = [line.strip() for line in file]
    except OSError as error:
        raise LaunchError(
            f"cannot read PBS_NODEFILE={path} ({error.strerror}); inside a PBS job it names the job's hosts"
        ) from None
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        raise LaunchError(f"PBS_NODEFILE={path} is empty; it should list the job's hosts, one per line")
    return lines


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
    """This host's name, long and short (a node file may list either)."""
    name = socket.gethostname()
    return {name, name.split(".")[0]}


def place_of_this_host(hosts):
    mine = this_host_names()
    for place, host in enumerate(hosts):
        if host in mine or host.split(".")[0] in mine:
            return place
    return None


# ---------------------------------------------------------------- node rank

def pbs_node_rank(env, lines, hosts):
    """This host's place among the job's hosts, checked against what pbsdsh says."""
    nodenum = int_var(env, "PBS_NODENUM")
    place = 0 if len(hosts) == 1 else place_of_this_host(hosts)
    # The job script is task 1 of its job; pbsdsh's tasks get other numbers (00000002, 40000001, ...).
    pbsdsh_task = int_var(env, "PBS_TASKNUM") not in (None, 1)
    if place is not None and pbsdsh_task and lines.count(hosts[place]) > 1:
        times = lines.count(hosts[place])
        raise LaunchError(
            f"PBS_NODEFILE lists {hosts[place]} {times} times, so pbsdsh starts {times} launchers there; "
            "ask for one chunk per host: select=N:...:mpiprocs=1 and -l place=scatter"
        )
    if len(hosts) == 1:
        return 0, "one node"
    if place is None:
        if nodenum is None:
            raise LaunchError(
                f"this host ({socket.gethostname()}) is not in PBS_NODEFILE ({', '.join(hosts)}); "
                "start the launcher on the job's nodes (pbsdsh), which also sets PBS_NODENUM"
            )
        if nodenum >= len(hosts):
            raise LaunchError(
                f"this is node {nodenum} (PBS_NODENUM) but PBS_NODEFILE names only {len(hosts)} distinct host(s) "
                f"({', '.join(hosts)}); ask for one chunk per host: mpiprocs=1 and -l place=scatter"
            )
        return nodenum, f"PBS_NODENUM={nodenum} (this host, {socket.gethostname()}, is not named in PBS_NODEFILE)"
    if nodenum is not None and nodenum != place:
        raise LaunchError(
            f"this host ({hosts[place]}) is host {place} of PBS_NODEFILE, but PBS_NODENUM={nodenum}; "
            "run the launcher through pbsdsh with one chunk per host (mpiprocs=1, -l place=scatter)"
        )
    return place, (f"{hosts[place]}'s place in PBS_NODEFILE"
                   + (f"; PBS_NODENUM={nodenum} agrees" if nodenum is not None else ""))


# ---------------------------------------------------------------- processes per node

def nvidia_driver_lists_gpus():
    return os.path.isdir(NVIDIA_GPUS) and bool(os.listdir(NVIDIA_GPUS))


def visible_gpus(ask_torch=False):
    """GPUs torch can see here (it honours CUDA_VISIBLE_DEVICES).

    Importing torch takes seconds, so it is skipped where the NVIDIA driver lists no GPU, unless
    ``ask_torch``: a job granted GPUs asks torch itself (a ROCm build or a container has no such list).
    """
    if not ask_torch and not nvidia_driver_lists_gpus():
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def count_cuda_visible_devices(value):
    """How many devices CUDA_VISIBLE_DEVICES lets CUDA see ("" and "-1" hide all).

    CUDA reads the list up to the first entry that is not a device index or UUID.
    """
    count = 0
    for entry in value.split(","):
        if not re.fullmatch(r"\d+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+", entry.strip()):
            break
        count += 1
    return count


def exec_vnode_gpus(exec_vnode, hosts):
    """ngpus of this host in a PBS exec_vnode such as '(gpu01:ncpus=8:ngpus=2)+(gpu02:ncpus=8:ngpus=2)'.

    None when no vnode of this host there names ngpus (the site does not define it, or the
    job asked for none). A host's vnodes are named HOST or HOST[i].
    """
    total, named = 0, False
    for vnode_spec in re.split(r"[()+]+", exec_vnode):
        name, *resources = vnode_spec.split(":")
        if not name or not any(name == host or name.startswith(f"{host}[") for host in hosts):
            continue
        for resource in resources:
            key, _, value = resource.partition("=")
            if key == "ngpus" and value.isdigit():
                total, named = total + int(value), True
    return total if named else None


def pbs_job_gpus(job_id, host):
    """The job's ngpus on this host, as the PBS server granted it (qstat -f), or None."""
    qstat = pbs_command("qstat")
    if not qstat or not job_id:
        return None
    try:
        result = subprocess.run([qstat, "-f", "-F", "json", job_id], capture_output=True, text=True, timeout=30)
        jobs = json.loads(result.stdout)["Jobs"] if result.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError):
        return None
    exec_vnode = next(iter(jobs.values()), {}).get("exec_vnode", "")
    return exec_vnode_gpus(exec_vnode, {host, host.split(".")[0]})


def granted_gpus(env, scheduler, host):
    """(GPUs granted to this job on this node, where that was read), or (None, "") if nothing says."""
    if scheduler == "slurm" and int_var(env, "SLURM_GPUS_ON_NODE") is not None:
        return int_var(env, "SLURM_GPUS_ON_NODE"), f"SLURM_GPUS_ON_NODE={env['SLURM_GPUS_ON_NODE']}"
    if "CUDA_VISIBLE_DEVICES" in env:
        value = env["CUDA_VISIBLE_DEVICES"]
        return count_cuda_visible_devices(value), f"CUDA_VISIBLE_DEVICES={value or '(empty)'}"
    return scheduler_granted_gpus(env, scheduler, host)


def scheduler_granted_gpus(env, scheduler, host):
    """(GPUs the scheduler itself says it granted on this node, where), or (None, ""): never CUDA_VISIBLE_DEVICES,
    which a job may inherit from the shell it was submitted from."""
    if scheduler == "slurm" and int_var(env, "SLURM_GPUS_ON_NODE") is not None:
        return int_var(env, "SLURM_GPUS_ON_NODE"), f"SLURM_GPUS_ON_NODE={env['SLURM_GPUS_ON_NODE']}"
    if scheduler == "pbs":
        if int_var(env, "NGPUS") is not None:
            return int_var(env, "NGPUS"), f"NGPUS={env['NGPUS']}"
        gpus = pbs_job_gpus(env.get("PBS_JOBID"), host)
        if gpus is not None:
            return gpus, f"ngpus={gpus} on {host} in the job's exec_vnode (qstat -f)"
    return None, ""


def cpus_here(env, scheduler):
    granted = int_var(env, {"pbs": "NCPUS", "slurm": "SLURM_CPUS_ON_NODE"}.get(scheduler, ""))
    if granted:
        return granted, f"{'NCPUS' if scheduler == 'pbs' else 'SLURM_CPUS_ON_NODE'}={granted}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, f"{cores} cores"


def why_torch_sees_no_gpu(env=None):
    """The likely reason torch sees no GPU on a GPU node, and its fix, in a few words."""
    env = os.environ if env is None else env
    try:
        import torch
    except ImportError:
        return "python cannot import torch: check the environment job_scripts/site.sh sets up"
    hidden = env.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and count_cuda_visible_devices(hidden) == 0:
        return (f"CUDA_VISIBLE_DEVICES={hidden or '(empty)'} hides every GPU: unset it, or ask your site why the job "
                "has it")
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build in the job's environment "
                "(README: Which CUDA build)")
    if not nvidia_driver_lists_gpus():
        return ("this node has no NVIDIA driver loaded (no /proc/driver/nvidia/gpus): submit to the GPU queue or "
                "partition, or load the module your site's GPU nodes need (COURSE_MODULES in job_scripts/site.sh)")
    return (f"this torch is built for CUDA {torch.version.cuda} and the node's driver cannot run it, likely an older "
            "driver: install the build that matches `nvidia-smi`'s CUDA version (README: Which CUDA build)")


def cpu_fallback_allowed(env):
    value = env.get(CPU_FALLBACK, "no")
    if value not in ("yes", "no"):
        raise LaunchError(f"{CPU_FALLBACK}={value!r}: set it to yes or no in job_scripts/site.sh")
    return value == "yes"


def check_granted_gpus_seen(env, scheduler, host, granted, source, seen, warnings):
    """Stop where the scheduler granted GPUs that torch cannot see; the site may allow CPUs instead.

    True when the run goes on on CPUs. A partial view (torch sees some, not all) always stops. Only the
    scheduler's own word is a grant here: a CUDA_VISIBLE_DEVICES may be inherited from the submitting shell,
    so a count from it that torch does not see is a warning.
    """
    if not granted or seen >= granted:
        return False
    if source.startswith("CUDA_VISIBLE_DEVICES"):  # the grant is the scheduler's word (a PBS cgroup sets both)
        by_scheduler = scheduler_granted_gpus(env, scheduler, host)
        if scheduler == "none" or not by_scheduler[0]:
            warnings.append(f"{source} names {granted} GPU(s) but torch sees {seen or 'none'}: check `nvidia-smi`")
            return False
        granted, source = by_scheduler
    what = f"the job was granted {granted} GPU(s) on {host} ({source}) but torch sees"
    if seen:
        raise LaunchError(f"{what} only {seen}: check `nvidia-smi` and CUDA_VISIBLE_DEVICES on this node (a GPU in a "
                          f"bad state, MIG); {CPU_FALLBACK} does not apply to a partial view")
    if cpu_fallback_allowed(env):
        warnings.append(f"{what} none: running on CPUs, as {CPU_FALLBACK}=yes in job_scripts/site.sh allows")
        return True
    raise LaunchError(f"{what} none: {why_torch_sees_no_gpu(env)}. A site without GPUs: {CPU_FALLBACK}=yes in "
                      "job_scripts/site.sh, or submit without the GPU request (PBS: the job's select without ngpus; "
                      "Slurm: --gres=none)")


def check_gpus_here(env):
    """The GPU check alone, on this node of a one-node job (the JupyterLab jobs): its warnings, or LaunchError."""
    scheduler, host, warnings = detect_scheduler(env), env.get("SLURMD_NODENAME") or socket.gethostname(), []
    if scheduler == "pbs" and env.get("PBS_NODEFILE"):
        host = read_nodefile(env["PBS_NODEFILE"])[0]  # as the job's exec_vnode names it
    granted, source = granted_gpus(env, scheduler, host)
    check_granted_gpus_seen(env, scheduler, host, granted, source, visible_gpus(ask_torch=bool(granted)), warnings)
    return warnings


def processes_per_node(env, scheduler, host, requested, warnings, gpus_per_process=1):
    granted, source = granted_gpus(env, scheduler, host)
    seen = visible_gpus(ask_torch=bool(granted))
    on_cpus = check_granted_gpus_seen(env, scheduler, host, granted, source, seen, warnings)
    if requested is not None:
        return requested, "--nproc-per-node"
    if on_cpus:  # the layout the GPUs would have had, so the job runs as it would on them
        if granted < gpus_per_process:
            raise LaunchError(f"each process needs {gpus_per_process} GPUs (--gpus-per-process) and this node was "
                              f"granted {granted} ({source}); ask the job for {gpus_per_process} or more")
        per_gpus = f"one per {gpus_per_process} GPUs" if gpus_per_process > 1 else "one per GPU"
        return granted // gpus_per_process, f"{per_gpus} granted, on CPUs: {source}"
    if gpus_per_process > 1 and (granted or seen):  # a model whose replica spans several GPUs
        gpus = granted or seen
        if gpus < gpus_per_process:
            raise LaunchError(f"each process needs {gpus_per_process} GPUs (--gpus-per-process) and this node has "
                              f"{gpus} ({source or 'torch sees them'}); ask the job for {gpus_per_process} or more")
        return gpus // gpus_per_process, f"one per {gpus_per_process} GPUs: {source or f'{seen} torch sees'}"
    if granted:
        if seen > granted:
            warnings.append(
                f"torch sees {seen} GPUs on this node but the job was granted {granted} ({source}); without "
                f"GPU isolation (CUDA_VISIBLE_DEVICES) the {granted} process(es) use GPUs 0..{granted - 1}, "
                "which may be another job's: ask your site how jobs get their own GPUs"
            )
        return granted, f"one per GPU granted: {source}"
    if seen and scheduler == "none":
        return seen, f"one per GPU torch sees ({seen})"
    if seen and granted is None:
        raise LaunchError(
            f"torch sees {seen} GPU(s) on this node, but nothing says how many this job was granted "
            "(no CUDA_VISIBLE_DEVICES, NGPUS or ngpus in the job's resources); pass the number: "
            "--nproc-per-node N (in a job: COURSE_LAUNCH_ARGS=\"--nproc-per-node N\")"
        )
    if seen:  # granted 0, yet GPUs in view: the scripts' --device auto would take them
        warnings.append(f"the job was granted no GPU ({source}) but torch sees {seen}; "
                        "pass --device cpu to the script to stay off them")
    cpus, where = cpus_here(env, scheduler)
    gpus = f"{source}, so " if source else ""
    return max(1, min(cpus, CPU_PROCS_CAP)), f"no GPU ({gpus}CPUs: {where}, at most {CPU_PROCS_CAP})"


# ---------------------------------------------------------------- the plan

def job_port(job_id):
    """The rendezvous port of a job: the same on every node, usually different between jobs."""
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def plan_from_env(env, nproc_per_node=None, port=None, max_restarts=DEFAULT_MAX_RESTARTS, gpus_per_process=1):
    scheduler = detect_scheduler(env)
    if scheduler == "pbs":
        job_id = env.get("PBS_JOBID") or "interactive"
        lines = read_nodefile(env.get("PBS_NODEFILE"))
        hosts = unique_in_order(lines)
        hosts_source = f"PBS_NODEFILE: {len(lines)} line(s), duplicates dropped"
        node_rank, rank_source = pbs_node_rank(env, lines, hosts)
    elif scheduler == "slurm":
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        variable = next((name for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                         if env.get(name)), None)
        if not variable:
            raise LaunchError("SLURM_JOB_NODELIST is not set; run this inside a Slurm job (sbatch/salloc + srun)")
        hosts = unique_in_order(slurm_hosts(env[variable]))
        hosts_source = f"{variable}={env[variable]}"
        tasks, nodes = int_var(env, "SLURM_STEP_NUM_TASKS"), int_var(env, "SLURM_STEP_NUM_NODES")
        if tasks and nodes and tasks > nodes:
            raise LaunchError(
                f"srun started {tasks} launchers on {nodes} node(s); start one per node: srun --ntasks-per-node=1"
            )
        if len(hosts) > 1 and not env.get("SLURM_STEP_ID"):
            raise LaunchError(
                f"this job has {len(hosts)} nodes; start the launcher on each with srun --ntasks-per-node=1"
            )
        node_rank = int_var(env, "SLURM_NODEID")
        rank_source = f"SLURM_NODEID={node_rank}"
        if node_rank is None:
            node_rank = place_of_this_host(hosts)
            rank_source = "this host's place in the node list"
            if node_rank is None and len(hosts) > 1:
                raise LaunchError(
                    f"this host ({socket.gethostname()}) is not in {variable} ({', '.join(hosts)}); "
                    "start the launcher with srun"
                )
        if node_rank is not None and node_rank >= len(hosts):
            raise LaunchError(
                f"this is node {node_rank} but {variable} names only {len(hosts)} host(s) ({', '.join(hosts)})"
            )
    else:
        job_id, hosts, hosts_source = None, [socket.gethostname()], "this machine (no scheduler)"
        node_rank, rank_source = 0, "one node"
    if len(hosts) == 1:
        node_rank, rank_source = 0, "one node"
    warnings = []
    nproc, nproc_source = processes_per_node(env, scheduler, hosts[node_rank], nproc_per_node, warnings,
                                             gpus_per_process)
    if len(hosts) > 1:
        port = port if port is not None else job_port(job_id)
    return Plan(scheduler, job_id, hosts, hosts_source, node_rank, rank_source, nproc, nproc_source,
                port if len(hosts) > 1 else None, max_restarts, warnings)


# ---------------------------------------------------------------- the torchrun command

def torchrun_options(plan, join_timeout=DEFAULT_JOIN_TIMEOUT):
    """torchrun's options in groups: the world, the rendezvous, the restarts and signals."""
    world = [f"--nnodes={plan.nnodes}", f"--nproc-per-node={plan.nproc_per_node}"]
    ending = [f"--max-restarts={plan.max_restarts}", f"--signals-to-handle={FORWARDED_SIGNALS}"]
    if plan.nnodes == 1:
        return [["--standalone", *world], ending]
    # is_host: the first host of the list runs the rendezvous store. Said explicitly,
    # because torch's own guess compares host names and IPs and can miss (an alias,
    # a second network interface), and then no node, or two, would host it. No
    # --node-rank: c10d ignores it and ranks the nodes by their sorted host names.
    is_host = 1 if plan.node_rank == 0 else 0
    rendezvous = [
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={plan.endpoint}",
        f"--rdzv-id={plan.rdzv_id}",
        f"--rdzv-conf=is_host={is_host},join_timeout={join_timeout}",
    ]
    return [world, rendezvous, ending]


def torchrun_command(plan, script, script_args, join_timeout=DEFAULT_JOIN_TIMEOUT, python=sys.executable):
    options = [option for group in torchrun_options(plan, join_timeout) for option in group]
    return [python, "-m", "torch.distributed.run", *options, script, *script_args]


def readable_command(plan, script, script_args, join_timeout=DEFAULT_JOIN_TIMEOUT, python=sys.executable):
    """The same command over a few lines, ready to paste into a shell."""
    lines = [shlex.join([python, "-m", "torch.distributed.run"])]
    lines += [shlex.join(group) for group in torchrun_options(plan, join_timeout)]
    lines.append(shlex.join([script, *script_args]))
    return " \\\n    ".join(lines)


def describe(plan, script_args=()):
    """What was derived, and from where: the first lines of a job's launch, and --dry-run's output."""
    where = {"pbs": f"PBS job {plan.job_id}", "slurm": f"Slurm job {plan.job_id}",
             "none": "no scheduler"}[plan.scheduler]
    if plan.port is None:
        rendezvous = ("none", "one node: torchrun --standalone")
    else:
        rendezvous = (f"c10d at {plan.endpoint}", f"port from the job id; rendezvous id {plan.rdzv_id}")
    rows = [
        ("hosts", ", ".join(plan.hosts), plan.hosts_source),
        ("this node", f"{plan.node_rank} of {plan.nnodes}", plan.rank_source),
        ("processes", f"{plan.nproc_per_node} per node", plan.nproc_source),
        ("rendezvous", *rendezvous),
        # The training scripts resume a restarted group whatever their flags (machinery/resume.py);
        # --resume makes a rerun or requeued job, a first attempt again, resume too.
        ("restarts", f"up to {plan.max_restarts}", "torchrun --max-restarts; " + (
            "a restart and a rerun job continue from the last checkpoint" if "--resume" in script_args
            else "a restart continues from the last checkpoint; no --resume: a rerun job starts over")),
        *([("ranks", "set by torchrun",
            "c10d orders the nodes by host name; the pre-flight line shows each host's ranks")]
          if plan.port is not None else []),
    ]
    width = max(len(value) for _, value, _ in rows)
    lines = [f"launch.py: {where}"]
    lines += [f"  {name:<11} {value:<{width}}   {source}" for name, value, source in rows]
    lines += [f"launch.py: warning: {warning}" for warning in plan.warnings]
    return "\n".join(lines)


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
    parser.add_argument("--dry-run", action="store_true",
                        help="print what was derived and the torchrun command; run nothing")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="processes on this node (default: GPUs granted, else CPUs up to 4)")
    parser.add_argument("--gpus-per-process", type=int, default=1, metavar="K",
                        help="GPUs each process uses (2: DDP with model parallelism); processes = GPUs // K")
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="K",
                        help=f"times torchrun restarts a failed worker group (default {DEFAULT_MAX_RESTARTS})")
    parser.add_argument("--port", type=int, default=None, metavar="P",
                        help="rendezvous port on the first host (default: derived from the job id)")
    parser.add_argument("--join-timeout", type=int, default=DEFAULT_JOIN_TIMEOUT, metavar="S",
                        help=f"seconds to wait for every node to join (default {DEFAULT_JOIN_TIMEOUT})")
    parser.add_argument("--check-gpus", action="store_true",
                        help="only check that torch sees the GPUs the job was granted here; start nothing")
    parser.add_argument("script", nargs="?", help="the training script, e.g. scripts/step4_ddp.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script unchanged")
    args = parser.parse_args(argv)
    if args.script is None and not args.check_gpus:
        parser.error("the training script is missing, e.g. scripts/step4_ddp.py")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be at least 1")
    if args.gpus_per_process < 1:
        parser.error("--gpus-per-process must be at least 1")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be 0 or more")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error("--port must be between 1 and 65535")
    if args.join_timeout < 1:
        parser.error("--join-timeout must be at least 1")
    return args


def main(argv=None, env=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    try:
        if args.check_gpus:
            for warning in check_gpus_here(env):
                print(f"launch.py: warning: {warning}", file=sys.stderr, flush=True)
            return 0
        if not os.path.isfile(args.script):
            raise LaunchError(
                f"no such training script: {args.script} (run from the course directory, e.g. scripts/step4_ddp.py)"
            )
        plan = plan_from_env(env, args.nproc_per_node, args.port, args.max_restarts, args.gpus_per_process)
        command = torchrun_command(plan, args.script, args.script_args, args.join_timeout)
        if args.dry_run:
            print(describe(plan, args.script_args))
            print(readable_command(plan, args.script, args.script_args, args.join_timeout), flush=True)
            return 0
        print(describe(plan, args.script_args), file=sys.stderr, flush=True)
        if plan.port is not None:
            check_resolves(plan.hosts[0])
            if plan.node_rank == 0:
                check_port_free(plan.port)
    except LaunchError as error:
        print(f"launch.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    if plan.max_restarts > 0:
        # torch 2.14's torchrun hands a restarted group the store of the failed attempt, and a
        # worker can then read a dead peer's address (pytorch/pytorch#167288): a fresh store for
        # each attempt instead (kit.launch_checks.FRESH_STORE_PER_ATTEMPT).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    print(f"launch.py: exec {shlex.join(command)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(command[0], command)  # torchrun takes over this process: its exit status is the job's


if __name__ == "__main__":
    sys.exit(main())
