"""Hangs made on purpose, each ended by the process group's timeout: what the waiting ranks see, and what
the debugging tools show about it. Notebook 09 runs them.

    torchrun --standalone --nproc-per-node=2 scripts/demos/hangs.py --demo shapes --timeout 3
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 scripts/demos/hangs.py \\
        --demo shapes ops skip --timeout 3
    torchrun --standalone --nproc-per-node=2 scripts/demos/hangs.py --demo uneven --timeout 3
    torchrun --standalone --nproc-per-node=2 scripts/demos/hangs.py --demo skip-then-barrier --timeout 30
        (and meanwhile, from another terminal: py-spy dump --pid PID, for each rank's PID)

Every rank must call the same collectives, in the same order, with tensors of the same shape. Each demo
breaks that rule once, in 2 or 3 CPU processes with gloo (--backend nccl: one GPU per process):

  shapes             every rank all_reduces its list of metrics, and rank 1's list is one longer
  ops                rank 0 calls all_reduce where rank 1 calls broadcast
  skip               rank 0 all_reduces inside ``if rank == 0:``; the other ranks go on with work that takes
                     longer than --timeout (a sleep stands in for it)
  skip-then-barrier  the same all_reduce, but the other ranks go straight on to their next collective, a
                     barrier: every rank waits, each in another collective (the case for py-spy)
  uneven             --short-rank has one batch fewer than the others: it evaluates (for longer than --timeout)
                     while they wait in the all_reduce of a batch it never had; the course's straggler watch
                     says which rank is behind
  uneven-then-barrier  the same, but the short rank goes straight on to the end-of-epoch barrier

With TORCH_DISTRIBUTED_DEBUG=DETAIL, PyTorch checks every collective before it runs: a mismatch raises on
every rank at once, before any byte moves, and the process group stays usable, so one run shows several
(``shapes ops skip``). Without it, a mismatch may return wrong numbers on one rank and fail elsewhere,
later, with a message that names no mismatch. Whatever fails is printed as the first line of the error
each rank got, ``error: ...``.
"""
import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch
import torch.distributed as dist

from demos import runner
from kit.errors import first_line
from lesson import process
from machinery import cli, stragglers


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner.add_demo_arguments(parser, DEMOS, default=["skip"])
    parser.add_argument("--timeout", type=cli.positive_int, default=3, help="seconds a collective may wait")
    parser.add_argument("--short-rank", type=int, default=1, help="uneven: the rank with one batch fewer (default 1)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="gloo on the CPU (default), or nccl on cuda:LOCAL_RANK (a GPU node)")
    parser.set_defaults(threads=1, seed=0)
    args = parser.parse_args(argv)
    args.device = "cuda" if args.backend == "nccl" else "cpu"
    return args


def allow_py_spy():
    """Let any process of this user read this one's stack with py-spy.

    Where the kernel's Yama module restricts ptrace to a process's ancestors (ptrace_scope 1, as Ubuntu's
    /etc/sysctl.d/10-ptrace.conf sets it), a py-spy started from another shell may not attach;
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) lifts that for this process alone (man 2const PR_SET_PTRACER).
    Elsewhere the call does nothing.
    """
    PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: py-spy has its own rules there


def busy(seconds):
    """Work that takes ``seconds`` and calls no collective (a long evaluation, a slow disk)."""
    time.sleep(seconds)


def backend_message(error):
    """The first line of a backend's error, without the C++ source location gloo puts in front of it."""
    return re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", first_line(error))


def is_mismatch(error):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL's verdict on a collective, raised before it runs."""
    return "Detected mismatch between collectives" in str(error)


def report_mismatch(runtime, error):
    """Every rank got the check's error; rank 0 prints each rank's, in rank order."""
    lines = process.gather_from_all_ranks(f"{type(error).__name__}: {first_line(error)}")
    runner.say(runtime, *(f"rank {rank}: {line}" for rank, line in enumerate(lines)))
    return {"mismatch": lines}


def demo_shapes(runtime, args):
    metrics = torch.ones(3 + runtime.rank, device=runtime.device)  # rank 1 added a metric of its own
    try:
        dist.all_reduce(metrics)
    except RuntimeError as error:
        if not is_mismatch(error):
            raise
        return report_mismatch(runtime, error)
    # Without the check, a rank can come back from a mismatched all_reduce as if nothing were wrong.
    print(f"rank {runtime.rank}: all_reduce returned {metrics.tolist()}", flush=True)
    busy(10 * args.timeout)  # the rest of its step, during which the other rank gives up
    return {"returned": metrics.tolist()}


def demo_ops(runtime, args):
    values = torch.ones(3, device=runtime.device)
    try:
        if runtime.rank == 0:
            dist.all_reduce(values)
        else:
            dist.broadcast(values, src=0)
    except RuntimeError as error:
        if not is_mismatch(error):
            raise
        return report_mismatch(runtime, error)
    print(f"rank {runtime.rank}: returned {values.tolist()}", flush=True)
    busy(10 * args.timeout)
    return {"returned": values.tolist()}


def demo_skip(runtime, args):
    loss = torch.ones(1, device=runtime.device)
    if runtime.rank == 0:
        dist.all_reduce(loss)  # the global loss, for rank 0's log line: the other ranks never come
    else:
        busy(10 * args.timeout)
    return {}


def demo_skip_then_barrier(runtime, args):
    allow_py_spy()
    loss = torch.ones(1, device=runtime.device)
    print(f"rank {runtime.rank}: waiting in a collective", flush=True)
    if runtime.rank == 0:
        dist.all_reduce(loss)  # rank 0 waits here for the others ...
    dist.barrier()  # ... and the others wait here for rank 0
    return {}


def demo_uneven(runtime, args):
    """Each rank trains on its own number of batches, one all_reduce of the gradients per batch, then
    evaluates. The straggler watch posts each rank's position, as it does in the training scripts."""
    watch = stragglers.StragglerWatch(runtime)
    batches = train_on_my_batches(runtime, args, watch)
    watch.post(batches, "ending the epoch", now=True)
    busy(10 * args.timeout)  # the evaluation
    watch.close()
    return {"batches": batches}


def demo_uneven_then_barrier(runtime, args):
    """The same epoch, but a rank that has trained on its batches waits for the others at the epoch's end."""
    allow_py_spy()
    batches = train_on_my_batches(runtime, args)
    print(f"rank {runtime.rank}: {batches} batches trained", flush=True)
    dist.barrier()  # the end of the epoch: every rank waits here for the others
    return {"batches": batches}


def train_on_my_batches(runtime, args, watch=None):
    """--short-rank has one batch fewer than the others (3): its shard ran out first."""
    gradients = torch.ones(4, device=runtime.device)
    batches = 2 if runtime.rank == args.short_rank else 3
    for step in range(batches):
        if watch:
            watch.post(step, "training")
        dist.all_reduce(gradients)  # the gradient average of this batch
        if watch:
            watch.post(step + 1, "between steps")
    return batches


DEMOS = {"shapes": demo_shapes, "ops": demo_ops, "skip": demo_skip, "skip-then-barrier": demo_skip_then_barrier,
         "uneven": demo_uneven, "uneven-then-barrier": demo_uneven_then_barrier}


def main(args):
    runtime = runner.setup(args)
    try:
        runner.run_demos(runtime, args, DEMOS)
    except RuntimeError as error:  # a collective that failed, as the backend told this rank
        line = stragglers.explain(error) or f"rank {runtime.rank}: {type(error).__name__}: {backend_message(error)}"
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main, parse=parse_args)
