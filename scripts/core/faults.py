"""Fault drills: make a rank die, exit or stall at a chosen step, to watch what follows.

    torchrun --nproc-per-node=2 --max-restarts=1 scripts/train_ddp.py --fault kill --fault-rank 1 --fault-step 20

A drill strikes only in a run's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT is
0 or unset): after torchrun restarts the group, training goes on past the same step.
The signals are real: ``kill`` is SIGKILL, as the kernel's out-of-memory killer sends it.
"""
import os
import signal
import sys
import time


def first_attempt():
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def strikes(args, rank, step, kind):
    return args.fault == kind and rank == args.fault_rank and step == args.fault_step and first_attempt()


def after_step(args, rank, step):
    """Called by every rank after each optimizer step."""
    if strikes(args, rank, step, "kill"):
        print(f"fault drill: rank {rank} kills itself (SIGKILL) after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if strikes(args, rank, step, "exit"):
        print(f"fault drill: rank {rank} exits with status 3 after step {step}", flush=True)
        sys.stdout.flush()
        os._exit(3)  # no clean-up, no goodbye to the other ranks: as a crash would leave them
    if strikes(args, rank, step, "stall"):
        print(f"fault drill: rank {rank} stalls for {args.fault_seconds:.0f} s after step {step}", flush=True)
        time.sleep(args.fault_seconds)


def crash_while_saving(args, rank, step):
    """True when rank 0 should die halfway through writing its first checkpoint at or after --fault-step."""
    return args.fault == "crash-in-save" and rank == 0 and step >= args.fault_step and first_attempt()
