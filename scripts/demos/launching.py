"""How processes get started and learn who they are: torchrun, restarts, mp.spawn, and a hang.

    torchrun --standalone --nproc-per-node=2 scripts/demos/launching.py
    torchrun --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --max-restarts=1 scripts/demos/launching.py --fail-first-attempt 1
    torchrun --standalone --nproc-per-node=2 scripts/demos/launching.py --stall-rank 1 --timeout 5

Each rank reads what torchrun put in its environment (RANK, LOCAL_RANK, WORLD_SIZE, ...),
joins the process group with the env:// default (MASTER_ADDR and MASTER_PORT), and rank 0
prints what every rank saw, in rank order.

--fail-first-attempt R  rank R exits with an error in torchrun's first attempt
                        (TORCHELASTIC_RESTART_COUNT=0); with --max-restarts=1 torchrun
                        starts the whole group again and the second attempt goes through.
--stall-rank R          rank R never reaches the all_reduce (it sleeps instead, as a rank
                        stuck elsewhere would): the other ranks wait for it until --timeout
                        seconds have passed, then fail with one line saying so.

``spawned_worker`` is the same kind of worker started with torch.multiprocessing.spawn
instead of torchrun: the function must be importable from a module, because spawn
starts a fresh interpreter that finds the function by its module and name.
"""
import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch
import torch.distributed as dist

from kit.errors import CourseError
from machinery import cli

TORCHRUN_VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fail-first-attempt", type=int, default=None, metavar="R",
                        help="rank R fails in torchrun's first attempt (use with --max-restarts)")
    parser.add_argument("--stall-rank", type=int, default=None, metavar="R",
                        help="rank R never calls the all_reduce: the others time out")
    parser.add_argument("--timeout", type=cli.positive_int, default=60, help="seconds a collective may wait")
    return parser.parse_args(argv)


def torchrun_environment():
    """What torchrun told this process, from its environment."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise CourseError(f"{', '.join(missing)} not set: start this with torchrun, "
                          "e.g. torchrun --standalone --nproc-per-node=2 scripts/demos/launching.py")
    return {name: os.environ.get(name, "-") for name in TORCHRUN_VARIABLES}


def report(everyone):
    rows = [f"{'RANK':>4} {'LOCAL_RANK':>10} {'WORLD_SIZE':>10} {'LOCAL_WORLD_SIZE':>16} {'GROUP_RANK':>10}"
            "  MASTER_ADDR:MASTER_PORT"]
    for env in everyone:
        rows.append(f"{env['RANK']:>4} {env['LOCAL_RANK']:>10} {env['WORLD_SIZE']:>10} {env['LOCAL_WORLD_SIZE']:>16} "
                    f"{env['GROUP_RANK']:>10}  {env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    attempt = everyone[0]["TORCHELASTIC_RESTART_COUNT"]
    rows.append(f"attempt {attempt} (TORCHELASTIC_RESTART_COUNT={attempt}, "
                f"TORCHELASTIC_MAX_RESTARTS={everyone[0]['TORCHELASTIC_MAX_RESTARTS']})")
    return "\n".join(rows)


def gloo_message(error):
    """The first line of a gloo error, without the source-file prefix: '[.../pair.cc:123] Timed out ...'."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", first)


def wait_for_everyone(rank, timeout):
    """One all_reduce; a rank that never comes turns into a one-line error after ``timeout`` s."""
    ones = torch.ones(1)
    try:
        dist.all_reduce(ones)
    except (RuntimeError, dist.DistBackendError) as error:
        raise CourseError(f"rank {rank} gave up waiting in all_reduce for a rank that never came, "
                          f"after --timeout {timeout} s: {gloo_message(error)}") from None
    return int(ones.item())


def main(args):
    env = torchrun_environment()
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    if args.fail_first_attempt == rank and env["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise CourseError(f"rank {rank} fails on purpose in attempt 0; "
                          "torchrun --max-restarts=1 starts the group again")
    # env:// is the default: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from torchrun.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    if args.stall_rank == rank:
        time.sleep(10 * args.timeout)  # busy elsewhere: never reaches the all_reduce below
    joined = wait_for_everyone(rank, args.timeout)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, env)
    if rank == 0:
        print(report(everyone), flush=True)
        print(f"all_reduce of ones: {joined} = world size {world_size}", flush=True)


def spawned_worker(rank, world_size, port, record):
    """A worker for torch.multiprocessing.spawn: ``rank`` is the process index spawn passes first.

    No launcher set RANK or MASTER_ADDR, so the rendezvous is given explicitly.
    """
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        if rank == 0:
            Path(record).write_text(json.dumps({"world_size": world_size, "sum_of_rank_plus_one": total.item()}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main, parse=parse_args)
