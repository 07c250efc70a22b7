"""Fault drills: make a rank die, exit or stall after a chosen step, die while saving, or save onto a full disk, to
watch what follows. Machinery: a learner may skip this module (notebook 05 runs the drills).

    torchrun --nproc-per-node=2 --max-restarts=1 scripts/step4_ddp.py --fault kill --fault-rank 1 --fault-step 20
    torchrun --nproc-per-node=2 scripts/step4_ddp.py --fault sigterm --fault-step 20

Each drill wraps what it breaks: a step (a callback after it) or the checkpoint writer (job.py hands the
checkpointing callback the writer ``checkpoint_writer`` returns). A drill strikes
only in a run's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT is 0 or unset): after torchrun
restarts the group, training goes on past the same step. ``sigterm`` and ``sigint`` stop a run the way
a scheduler (SIGTERM) and Ctrl-C (SIGINT) do: the rank sends the signal to torchrun, which passes it on to
every worker (without torchrun, to itself), and waits until it has come back, so that the run stops after
the very next step (graceful_stop.py); ``sigterm-rank`` sends SIGTERM to its own rank alone, which the
others learn of only from the ranks' agreement. With ``--fault-every-attempt`` it strikes in
every attempt but the last one torchrun's --max-restarts allows, each one step later than the attempt
before (step --fault-step + the restart count), so that every restarted group makes progress first. The
signals are real: ``kill`` is SIGKILL, as the kernel's out-of-memory killer sends it.
"""
import atexit
import functools
import os
import shutil
import signal
import sys
import time

from kit import checkpoints
from kit.errors import CourseError
from kit.launch_checks import first_attempt, restart_count
from kit.output_paths import display_path
from lesson.loop import Callback

from . import signals


def drills(args, runtime):
    """The drill ``--fault`` asks for that strikes after a step, as callbacks (none without it)."""
    if args.fault in (None, "crash-in-save", "disk-full"):
        return []
    return [StrikeAfterStep(args, runtime)]


def checkpoint_writer(args, runtime):
    """What writes a checkpoint file: the atomic write, or on rank 0 under ``--fault crash-in-save`` the same
    write that dies halfway through the file at or after step --fault-step, under ``--fault disk-full`` the same
    write onto a file system filled just before."""
    wrappers = {"crash-in-save": write_or_crash, "disk-full": fill_then_write}
    if args.fault not in wrappers or not runtime.is_main:
        return checkpoints.write_atomically
    return functools.partial(wrappers[args.fault], args, checkpoints.write_atomically)


def strike_step(args):
    """The step after which the drill strikes in this attempt; None: not in this attempt. With
    --fault-every-attempt, every attempt but the last that torchrun's --max-restarts allows, so that the
    run can finish."""
    if args.fault_every_attempt:
        last = restart_count() >= int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        return None if last else args.fault_step + restart_count()
    return args.fault_step if first_attempt() else None


class StrikeAfterStep(Callback):
    """``--fault kill|exit|stall|sigterm|sigint``: rank --fault-rank, after step --fault-step (after that step's
    checkpoint)."""

    def __init__(self, args, runtime):
        self.args, self.rank, self.timeout = args, runtime.rank, runtime.timeout.total_seconds()

    def on_step_end(self, trainer):
        args, rank, step = self.args, self.rank, trainer.global_step
        if rank != args.fault_rank or step != strike_step(args):
            return
        if args.fault == "kill":
            print(f"fault drill: rank {rank} kills itself (SIGKILL) after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault == "exit":
            print(f"fault drill: rank {rank} exits with status 3 after step {step}", flush=True)
            sys.stdout.flush()
            os._exit(3)  # no clean-up, no goodbye to the other ranks: as a crash would leave them
        if args.fault == "stall":
            print(f"fault drill: rank {rank} stalls for {args.fault_seconds:.0f} s after step {step}", flush=True)
            time.sleep(args.fault_seconds)
        if args.fault in ("sigterm", "sigint", "sigterm-rank"):
            number = signal.SIGINT if args.fault == "sigint" else signal.SIGTERM
            self.signal(number, step, to_torchrun=args.fault != "sigterm-rank" and "TORCHELASTIC_RUN_ID" in os.environ)

    def signal(self, number, step, to_torchrun):
        """Send ``number`` to torchrun, or to this process alone, and wait until it has come back."""
        print(f"fault drill: rank {self.rank} sends {number.name} to {'torchrun' if to_torchrun else 'itself'} "
              f"after step {step}", flush=True)
        os.kill(os.getppid() if to_torchrun else os.getpid(), number)
        deadline = time.monotonic() + self.timeout
        while number not in signals.received and time.monotonic() < deadline:
            time.sleep(0.01)  # torchrun passes it on within a moment


def write_or_crash(args, write, state, path):
    """``--fault crash-in-save``: half the file written and fsync'ed, then SIGKILL, as a node that dies mid-write
    leaves it; every other checkpoint is written as usual."""
    strike = strike_step(args)
    if strike is None or state["global_step"] < strike:
        return write(state, path)
    print(f"fault drill: rank 0 dies halfway through writing {path.name}", flush=True)
    data = checkpoints.serialize(state)
    with open(checkpoints.temporary_path(path), "wb") as file:
        file.write(data[: len(data) // 2])
        file.flush()
        os.fsync(file.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


BALLAST = "disk-full-drill.ballast"


def fill_then_write(args, write, state, path):
    """``--fault disk-full``: at the first checkpoint from step --fault-step on, rank 0 fills the checkpoint
    folder's file system (the file disk-full-drill.ballast there, removed when the process exits), as another job's
    output filling a shared quota would, then writes the checkpoint for real: the write meets a full disk."""
    ballast = path.parent / BALLAST
    strike = strike_step(args)
    if strike is not None and state["global_step"] >= strike and not ballast.exists():
        print(f"fault drill: rank 0 fills the file system of {display_path(path.parent)} before writing {path.name}",
              flush=True)
        atexit.register(ballast.unlink, missing_ok=True)
        fill(ballast)
    return write(state, path)


FILL_AT_MOST = 1 << 30  # the drill fills a small file system (a tmpfs), never a shared one


def fill(path):
    """Write into ``path`` until the file system has no room left: random bytes, which no compression shrinks, and
    no more than the free space the file system reported (and a little)."""
    free = shutil.disk_usage(path.parent).free
    if free > FILL_AT_MOST:
        raise CourseError(f"--fault disk-full fills the checkpoint folder's file system, and "
                          f"{display_path(path.parent)} has {free / 2**30:.1f} GiB free: point --checkpoint-dir at a "
                          f"small file system, such as a tmpfs of 64 MiB (docs/troubleshooting.md, 17)")
    chunk, block, written = 1 << 20, os.urandom(1 << 20), 0
    with open(path, "wb", buffering=0) as file:
        while chunk >= 512 and written <= free + (1 << 20):
            try:
                wrote = file.write(block[:chunk]) or 0
            except OSError:
                wrote = 0
            written += wrote
            if not wrote:
                chunk //= 2  # full, or nearly: smaller pieces take the rest
