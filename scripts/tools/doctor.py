#!/usr/bin/env python3
"""The cluster doctor: did this job's ranks land where the job asked for them, and can they talk?

    qsub job_scripts/doctor.pbs          sbatch job_scripts/doctor.sbatch
    python scripts/tools/launch.py --max-restarts 0 scripts/tools/doctor.py     (what both jobs run)
    torchrun --standalone --nproc-per-node=2 scripts/tools/doctor.py             (by hand, on one node)

Every rank reports where it runs: host, rank, local rank, node rank (torchrun's GROUP_RANK), the GPUs it
sees (CUDA_VISIBLE_DEVICES, names, compute capability) and the one it would train on (cuda:LOCAL_RANK),
its CPU affinity and threads, the address gloo binds to (GLOO_SOCKET_IFNAME, else the address this
host's name resolves to; NCCL_SOCKET_IFNAME where set) and how MASTER_ADDR resolves from there. Rank 0
prints one table of it all, then one `diagnosis:` line for each misconfiguration it recognises, which
breaks a job or wastes what it asked for:

  two ranks on one GPU         ranks of one host that would train on the same GPU (NCCL refuses them:
                               "Duplicate GPU detected", src/init.cc of NVIDIA/nccl)
  fewer GPUs than ranks        a rank whose local rank has no GPU on its node (cuda:LOCAL_RANK missing)
  GPUs granted but unused      a host's ranks train on fewer GPUs than the job was granted there, and torch
                               sees them all (--nproc-per-node 1 on a 2-GPU grant)
  GPUs granted but unseen      a job's GPUs on a host that torch does not see all of, which the launcher
                               refuses too; where it sees none and the site allows a CPU fall-back
                               (COURSE_CPU_FALLBACK=yes in job_scripts/site.sh), a note instead
  a host listed twice          the job's host list names a host more than once, or one host runs the
                               ranks of two torchruns (two launchers on one host)
  a host not granted           a rank on a host that is not in the job's PBS_NODEFILE / SLURM_JOB_NODELIST
  a GPU without kernels        a GPU whose compute capability this torch build has no kernels for (the
                               pinned CUDA 13 wheels: no Volta); the line names the CUDA 12 route

and one `note:` line for what only costs speed, or is allowed:

  one CPU core per rank        the cores a node's ranks may use, divided by its ranks, is 1 or less (the
                               launcher's own layout on CPU nodes of at most 4 cores)
  GPUs granted but unseen      torch sees none, and the site lets jobs fall back to CPUs

Then one all_reduce (its sum must be the world size) and a short bandwidth probe across the ranks: an
all_reduce of --probe-mb MiB, timed on the slowest rank, with NCCL when every rank has a GPU of its own and
gloo otherwise. Exit status 1 when any diagnosis fired (on every rank, so the job fails), 0 otherwise: notes
do not change it.
"""
import argparse
import datetime
import fcntl
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and tools

import torch
import torch.distributed as dist

from kit import agreement, launch_checks
from kit.errors import CourseError
from lesson import process
from machinery import cli
from tools import launch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="for the all_reduce and the probe (auto: nccl when every rank has a GPU of its own)")
    parser.add_argument("--timeout", type=cli.positive_int, default=60, help="seconds a collective may wait")
    parser.add_argument("--probe-mb", type=cli.positive_int, default=16, help="MiB all-reduced by the probe")
    parser.add_argument("--probe-repeats", type=cli.positive_int, default=5, help="timed all_reduces in the probe")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- what one rank finds

@dataclass
class Report:
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    host: str
    cuda_visible_devices: str | None
    gpus: list  # [(name, "X.Y", uuid)] of the GPUs this process sees, by index
    no_kernels: list  # [(index, name, "X.Y")] of those this torch build cannot run on
    affinity: list  # the CPU cores this process may run on
    usable_cpus: int  # the same, capped by what the scheduler granted (lesson/process.usable_cpus)
    granted_cpus: str  # "NCPUS=2", "SLURM_CPUS_ON_NODE=8", or ""
    scheduler: str  # "pbs", "slurm" or "none" (tools/launch.detect_scheduler)
    granted_gpus: int | None  # the job's GPUs on this host (tools/launch.granted_gpus); None: nothing says
    granted_gpus_from: str  # "SLURM_GPUS_ON_NODE=2", "CUDA_VISIBLE_DEVICES=0,1", ...
    cpu_fallback: bool  # COURSE_CPU_FALLBACK=yes: the site lets a job granted GPUs it cannot see run on CPUs
    threads: int
    gloo: str  # what gloo binds to
    nccl_ifname: str | None
    master: str  # "MASTER_ADDR -> its address(es) via the interface that reaches it"

    @property
    def gpu(self):
        """The GPU this rank would train on, cuda:LOCAL_RANK, or None."""
        return self.gpus[self.local_rank] if self.local_rank < len(self.gpus) else None


def interface_addresses():
    """{IPv4 address: interface name} of this host (SIOCGIFADDR on each interface)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found[socket.inet_ntoa(packed[20:24])] = name
    return found


def resolve(name):
    """The IPv4 addresses ``name`` resolves to here, or the resolver's error."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)})
    except OSError as error:
        return f"does not resolve ({error.strerror or error})"


def route_to(address, port):
    """This host's address on the way to ``address`` (the kernel's choice of route), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
        try:
            probe.connect((address, port))
            return probe.getsockname()[0]
        except OSError:
            return None


def describe_address(name, port, interfaces):
    addresses = resolve(name)
    if isinstance(addresses, str):
        return f"{name} {addresses}"
    local = route_to(addresses[0], port)
    via = f" via {interfaces.get(local, '?')}" if local else ""
    return f"{name} -> {', '.join(addresses)}{via}"


def gloo_binding(host, interfaces):
    """What gloo binds to: GLOO_SOCKET_IFNAME's interfaces, else the address this host's name resolves to
    (ProcessGroupGloo's default device; loopback, with a warning, where the name does not resolve)."""
    wanted = os.environ.get("GLOO_SOCKET_IFNAME")
    if wanted:
        return f"{wanted} (GLOO_SOCKET_IFNAME)"
    addresses = resolve(host)
    if isinstance(addresses, str):
        return f"127.0.0.1 (lo: {host} {addresses})"
    return f"{addresses[0]} ({interfaces.get(addresses[0], 'not an address of this host')})"


def gpu_facts():
    if not torch.cuda.is_available():
        return [], []
    gpus, visible = [], os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        # The UUID tells two GPUs apart whatever their numbering; without one, the entry of CUDA_VISIBLE_DEVICES.
        entry = visible[index] if index < len(visible) and visible[index] else index
        identity = str(getattr(properties, "uuid", "") or "") or f"GPU {entry}"
        gpus.append((properties.name, f"{properties.major}.{properties.minor}", identity))
    return gpus, launch_checks.gpus_without_kernels()


def granted_cpus():
    for name in ("NCPUS", "SLURM_CPUS_ON_NODE"):  # PBS, Slurm: what lesson/process.usable_cpus caps with
        if os.environ.get(name, "").isdigit():
            return f"{name}={os.environ[name]}"
    return ""


def gpu_grant_here(env=None):
    """(the scheduler, GPUs the job was granted on this host, where that was read), as the launcher reads them;
    the count None if nothing says. Read on each host: the scheduler's variables differ between nodes."""
    env = os.environ if env is None else env
    scheduler, (_, listed) = launch.detect_scheduler(env), granted_hosts(env)
    place = launch.place_of_this_host(listed)
    name = listed[place] if place is not None else socket.gethostname()  # qstat's exec_vnode spells it so
    try:
        return scheduler, *launch.granted_gpus(env, scheduler, name)
    except launch.LaunchError as error:
        return scheduler, None, f"unreadable ({error})"


def this_rank():
    rank, local_rank, world_size, local_world_size = process.process_layout()
    host = socket.gethostname()
    interfaces = interface_addresses()
    gpus, no_kernels = gpu_facts()
    master = describe_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), interfaces)
    return Report(rank, local_rank, world_size, int(os.environ.get("GROUP_RANK", rank // local_world_size)), host,
                  os.environ.get("CUDA_VISIBLE_DEVICES"), gpus, no_kernels, sorted(os.sched_getaffinity(0)),
                  process.usable_cpus(), granted_cpus(), *gpu_grant_here(),
                  os.environ.get("COURSE_CPU_FALLBACK") == "yes", torch.get_num_threads(),
                  gloo_binding(host, interfaces), os.environ.get("NCCL_SOCKET_IFNAME"), master)


def granted_hosts(env=None):
    """(where from, the job's host list as the scheduler wrote it), or (None, []) outside a job."""
    env = os.environ if env is None else env
    try:
        if env.get("PBS_NODEFILE"):
            return "PBS_NODEFILE", launch.read_nodefile(env["PBS_NODEFILE"])
        if env.get("SLURM_JOB_NODELIST"):
            return "SLURM_JOB_NODELIST", launch.slurm_hosts(env["SLURM_JOB_NODELIST"])
    except launch.LaunchError as error:
        return f"unreadable ({error})", []
    return None, []


# ---------------------------------------------------------------- the table and the diagnoses

def short(host):
    return host.split(".")[0]


def ranks_text(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {launch_checks.format_ranks(sorted(ranks))}"


def by_host(reports):
    hosts = {}
    for report in reports:
        hosts.setdefault(report.host, []).append(report)
    return hosts


def table(reports):
    header = ["rank", "host", "node", "local", "GPU it would use", "CUDA_VISIBLE_DEVICES", "CPUs (affinity)",
              "threads", "gloo binds to", "MASTER_ADDR"]
    rows = [header]
    for r in reports:
        gpu = f"cuda:{r.local_rank} {r.gpu[0]} ({r.gpu[1]})" if r.gpu else (
            f"none of its own (sees {len(r.gpus)})" if r.gpus else "none")
        granted = f", {r.granted_cpus}" if r.granted_cpus else ""
        cpus = f"{r.usable_cpus} ({launch_checks.format_ranks(r.affinity)}{granted})"
        gloo = r.gloo + (f"; NCCL_SOCKET_IFNAME={r.nccl_ifname}" if r.nccl_ifname else "")
        rows.append([str(r.rank), r.host, str(r.node_rank), str(r.local_rank), gpu,
                     "unset" if r.cuda_visible_devices is None else repr(r.cuda_visible_devices), cpus,
                     str(r.threads), gloo, r.master])
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def shared_gpus(reports):
    lines = []
    for host, mine in by_host(reports).items():
        users = {}
        for r in mine:
            if r.gpu:
                users.setdefault(r.gpu[2], []).append(r)
        for same in (group for group in users.values() if len(group) > 1):
            lines.append(f"two ranks on one GPU: {ranks_text([r.rank for r in same])} on {host} would all train on "
                         f"{same[0].gpu[0]} {same[0].gpu[2]} (cuda:{', cuda:'.join(str(r.local_rank) for r in same)}): "
                         "NCCL refuses that ('Duplicate GPU detected'), and they would share its memory; start one "
                         "process per GPU, one torchrun per host, and leave CUDA_VISIBLE_DEVICES to the scheduler")
    return lines


def missing_gpus(reports):
    lines = []
    for host, mine in by_host(reports).items():
        seen = max(len(r.gpus) for r in mine)
        without = [r for r in mine if not r.gpu]
        if seen and without:
            lines.append(f"fewer GPUs than ranks: {host} runs {len(mine)} ranks but its processes see {seen} GPU(s): "
                         f"no cuda:LOCAL_RANK for {ranks_text([r.rank for r in without])} (local rank "
                         f"{', '.join(str(r.local_rank) for r in without)}); start one process per GPU "
                         f"(--nproc-per-node={seen}) or ask the job for {len(mine)} GPUs on each node")
    return lines


def gpu_grant(mine):
    """(GPUs granted on a host, where that was read, GPUs torch sees there), from the reports of its ranks."""
    granted = next((r for r in mine if r.granted_gpus is not None), None)
    seen = max(len(r.gpus) for r in mine)
    return (granted.granted_gpus, granted.granted_gpus_from, seen) if granted else (None, "", seen)


def unused_gpus(reports):
    lines = []
    for host, mine in by_host(reports).items():
        granted, source, seen = gpu_grant(mine)
        used = len({r.gpu[2] for r in mine if r.gpu})
        if granted and seen >= granted and used < granted:  # seen < granted: unseen, not unused
            lines.append(f"GPUs granted but unused: {host} was granted {granted} GPU(s) ({source}) and torch sees "
                         f"{seen}, but its ranks train on only {used} ({ranks_text([r.rank for r in mine])}); start "
                         "one process per GPU (drop --nproc-per-node: the launcher then starts one per GPU granted) "
                         f"or ask the job for {used} GPU(s) per node")
    return lines


def granted_unseen(reports):
    """(what was granted and not seen, GPUs seen, whether the site's CPU fall-back covers it) for each host where a
    scheduler granted GPUs that torch does not see all of: the hosts the launcher stops (tools/launch.py
    check_granted_gpus_seen, whose rule this follows: a CUDA_VISIBLE_DEVICES alone is no grant)."""
    for host, mine in by_host(reports).items():
        granted, source, seen = gpu_grant(mine)
        by_the_scheduler = all(r.scheduler != "none" for r in mine) and not source.startswith("CUDA_VISIBLE_DEVICES")
        if granted and seen < granted and by_the_scheduler:
            yield (f"GPUs granted but unseen: {host} was granted {granted} GPU(s) ({source}) but torch sees "
                   f"{seen or 'none'}", seen, not seen and all(r.cpu_fallback for r in mine))


def unseen_gpus(reports):
    lines = []
    for what, seen, allowed in granted_unseen(reports):
        if seen:
            lines.append(f"{what}: check `nvidia-smi` and CUDA_VISIBLE_DEVICES on that host")
        elif not allowed:
            lines.append(f"{what}: check the driver and the torch build (README: Which CUDA build); a site without "
                         "GPUs allows CPUs instead: COURSE_CPU_FALLBACK=yes in job_scripts/site.sh")
    return lines


def cpu_fallbacks(reports):
    return [f"{what}: running on CPUs (COURSE_CPU_FALLBACK=yes)" for what, _, allowed in granted_unseen(reports)
            if allowed]


def starved_cpus(reports):
    lines = []
    for host, mine in by_host(reports).items():
        cores = len({core for r in mine for core in r.affinity})
        granted = [r for r in mine if r.granted_cpus]
        if granted:
            cores = min(cores, min(r.usable_cpus for r in granted))
        if cores <= len(mine):
            source = f" ({granted[0].granted_cpus})" if granted else ""
            lines.append(f"one CPU core per rank: {host} runs {len(mine)} rank(s) on {cores} CPU core(s){source}, "
                         "which leaves no core for loading data or the backend's threads; ask the job for more cores "
                         "per node (PBS: ncpus in the select line; Slurm: --cpus-per-task) or start fewer processes "
                         "(--nproc-per-node)")
    return lines


def hosts_twice(reports, source, listed):
    lines = []
    for host in dict.fromkeys(listed):
        if listed.count(host) > 1:
            lines.append(f"a host listed twice: {source} lists {host} {listed.count(host)} times: the job's chunks "
                         "share that host, and the course's launcher starts one torchrun per distinct host, so the job "
                         f"runs on {len(set(listed))} host(s), not {len(listed)}; for one chunk per host ask PBS for "
                         "select=N:...:mpiprocs=1 and -l place=scatter")
    for host, mine in by_host(reports).items():
        nodes = sorted({r.node_rank for r in mine})
        if len(nodes) > 1:
            lines.append(f"a host listed twice: {host} runs the ranks of {len(nodes)} torchruns (node ranks "
                         f"{', '.join(map(str, nodes))}): two launchers on one host, each numbering its local ranks "
                         "from 0; start one torchrun per host (job_scripts/ do: pbsdsh on a host list without "
                         "duplicates, srun --ntasks-per-node=1)")
    return lines


def hosts_not_granted(reports, source, listed):
    if not listed:
        return []
    allowed = {short(host) for host in listed}
    lines = []
    for host, mine in by_host(reports).items():
        if short(host) not in allowed:
            lines.append(f"a host not granted: {ranks_text([r.rank for r in mine])} on {host}, which is not among "
                         f"the job's hosts ({source}: {', '.join(dict.fromkeys(listed))}); start the job's processes "
                         "inside the job, on its own nodes (the job scripts do), not on a login node or with another "
                         "job's host list")
    return lines


def gpus_without_kernels(reports):
    lines, seen = [], set()
    for r in reports:
        for index, name, capability in r.no_kernels:
            if (r.host, index) not in seen:
                seen.add((r.host, index))
                problem = launch_checks.architecture_problem(index, name, capability)
                lines.append(f"a GPU without kernels: on {r.host}, {problem}")
    return lines


def diagnose(reports, source=None, listed=()):
    """One line for each misconfiguration found in the ranks' reports and the job's host list: each fails the job."""
    listed = list(listed)
    return (shared_gpus(reports) + missing_gpus(reports) + unused_gpus(reports) + unseen_gpus(reports)
            + hosts_twice(reports, source, listed) + hosts_not_granted(reports, source, listed)
            + gpus_without_kernels(reports))


def notes(reports):
    """One line for each thing that costs speed, or that the site allows: none fails the job."""
    return starved_cpus(reports) + cpu_fallbacks(reports)


def verdict(problems, remarks):
    """The doctor's last line."""
    counted = f" ({len(remarks)} note{'s' if len(remarks) > 1 else ''})" if remarks else ""
    if problems:
        return f"doctor: {len(problems)} problem(s) found{counted}, exit status 1"
    return f"doctor: no problem found{counted}"


# ---------------------------------------------------------------- the network

def gpus_usable(reports, problems):
    gpu_problems = ("two ranks on one GPU", "fewer GPUs than ranks", "a GPU without kernels")
    return all(r.gpu for r in reports) and not any(line.startswith(gpu_problems) for line in problems)


def check_network(runtime_device, group, args):
    """One all_reduce of ones, then the probe: the sum, and the slowest rank's time per all_reduce."""
    ones = torch.ones(1, device=runtime_device)
    dist.all_reduce(ones, group=group)
    data = torch.ones(args.probe_mb * 2**20 // 4, device=runtime_device)
    dist.all_reduce(data, group=group)  # warm-up: connections, buffers
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(args.probe_repeats):
        dist.all_reduce(data, group=group)
    if runtime_device.type == "cuda":
        torch.cuda.synchronize(runtime_device)
    seconds = torch.tensor([(time.perf_counter() - start) / args.probe_repeats], device=runtime_device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return int(ones.item()), seconds.item()


def probe_line(backend, nodes, world_size, args, seconds):
    size = args.probe_mb * 2**20
    algbw = size / seconds / 1e9
    busbw = algbw * 2 * (world_size - 1) / world_size if world_size > 1 else algbw
    where = f"between {nodes} nodes" if nodes > 1 else "within one node"
    return (f"probe {where}: all_reduce of {args.probe_mb} MiB over {world_size} rank(s) with {backend}, "
            f"{seconds * 1e3:.1f} ms on the slowest rank: algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s")


# ---------------------------------------------------------------- the whole check

def main(args):
    if not launch_checks.launched_by_torchrun():
        launch_checks.use_world_of_one()  # plain python: a world of one, as the training scripts do
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    reports = agreement.gather_from_all_ranks(this_rank())
    me = reports[dist.get_rank()]
    source, listed = granted_hosts()
    problems, remarks = diagnose(reports, source, listed), notes(reports)
    nodes = len(by_host(reports))
    if me.rank == 0:
        print(f"doctor: {launch_checks.describe_world([r.host for r in reports])}")
        print(f"job's hosts: {f'{source}: ' + ', '.join(listed) if source else 'no scheduler (not checked)'}")
        print(table(reports))
        for line in problems:
            print(f"diagnosis: {line}")
        for line in remarks:
            print(f"note: {line}")
        sys.stdout.flush()
    if args.backend == "nccl" and not gpus_usable(reports, problems):
        raise CourseError("--backend nccl needs a GPU of its own, of an architecture this torch runs, for every rank; "
                          "see the diagnoses above, or use --backend gloo")
    backend = args.backend if args.backend != "auto" else ("nccl" if gpus_usable(reports, problems) else "gloo")
    device, group = torch.device("cpu"), None
    if backend == "nccl":
        device = torch.device("cuda", me.local_rank)
        torch.cuda.set_device(device)
        group = dist.new_group(backend="nccl")
    total, seconds = check_network(device, group, args)
    if total != me.world_size:
        problems.append(f"the all_reduce summed the ones of {total} rank(s), not {me.world_size}")
    if me.rank == 0:
        print(f"all_reduce with {backend}: the sum of ones is {total}, "
              f"{'the world size' if total == me.world_size else f'not the world size {me.world_size}'}")
        print(probe_line(backend, nodes, me.world_size, args, seconds) if me.world_size > 1
              else "probe: one rank, nothing to measure between ranks")
        print(verdict(problems, remarks), flush=True)
    dist.destroy_process_group()
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main, parse=parse_args)
