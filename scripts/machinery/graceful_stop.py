"""Stopping a run on purpose, with nothing lost: every rank stops at the same step, with a checkpoint of it.
Machinery: a learner may skip this module (notebook 05 and docs/running_on_a_cluster.md show it at work).

Three things ask a run to stop before its last epoch:

- a signal: SIGTERM (a scheduler at the walltime or on qdel/scancel, torchrun forwarding its own),
  SIGINT (Ctrl-C; a second one stops at once) or SIGUSR1 (Slurm's ``--signal`` warning);
- its time budget, ``--stop-after``: the run stops when the next steps and a checkpoint would no longer
  fit before it (the PBS jobs pass the walltime they were granted);
- a stop request: a file named ``STOP`` in the checkpoint folder (the Slurm jobs write it when the
  warning signal reaches the job shell; anyone may write it by hand).

A signal only sets a flag (signals.py, installed by ``cli.run`` before anything else). At every
step boundary each rank posts what it wants, and the ranks agree with one all_reduce (MAX) on a tiny
tensor, read one step later so that the GPU never waits for it: every rank stops after the same step, and
no rank saves a step the others did not take. The checkpointing callback writes that step's checkpoint,
rank 0 leaves a note in the folder (``STOPPED``: the reason and the step, for the job scripts) and prints
one line, and the process exits: status 0 when the run was asked to stop by its budget or a stop request
(torchrun must not restart it), 128 + the signal's number after a signal.

The same agreement stops a run whose loss is no longer finite (divergence.py): every rank stops after the same
step with one line, saving nothing of it, exit status 1.
"""
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from kit import checkpoints
from kit.agreement import fail_together, gather_from_all_ranks
from kit.errors import CourseError
from kit.output_paths import display_path
from lesson.loop import Callback
from lesson.models import unwrap

from . import divergence
from .signals import Stopped, received, set_stuck_after
from .walltime import clock, job_start

REQUEST_FILE = "STOP"  # in the checkpoint folder: "stop at the next step" (the Slurm jobs write it)
NOTE_FILE = "STOPPED"  # in the checkpoint folder: "<reason> <step>", written by rank 0 after a stop

# What a rank posts at a step boundary; the largest wins: a loss no longer finite (divergence.py), a signal, then
# a request, then the budget.
NOTHING, BUDGET, REQUEST, SIGNAL_BASE, NOT_FINITE = 0, 1, 2, 16, 1024


def reason_words(code):
    if code >= SIGNAL_BASE:
        return signal.Signals(code - SIGNAL_BASE).name
    return {BUDGET: "time-budget", REQUEST: "stop-request"}[code]


class GracefulStop(Callback):
    """Stop every rank after the same step, with a checkpoint of that step, when asked to (see above)."""

    def __init__(self, args, runtime, checkpointing, folder):
        self.args, self.runtime, self.checkpointing, self.folder = args, runtime, checkpointing, folder
        self.deadline = None
        if args.stop_after is not None:
            start, self.clock_start = job_start()
            self.deadline = start + args.stop_after
        self.longest_step = 0.0  # seconds between two step ends, the evaluation included at an epoch's end
        self.estimate = 0.0  # seconds a checkpoint would take, measured before the first one
        self.last_boundary = None
        self.first_step = None  # where this run started (a resumed run: the checkpoint's step)
        self.posted = None  # the all_reduce in flight: (work or event, tensor)
        self.posted_at = None  # (the step, this rank's loss of it) when it was posted
        self.pending = NOTHING  # an agreed stop that waits for the epoch's end
        set_stuck_after(self.stuck_after)  # what a SIGTERM's alarm waits for (signals.py)

    @property
    def longest_checkpoint(self):
        """Seconds the longest checkpoint of this run took (before the first one: the estimate)."""
        return max(self.estimate, self.checkpointing.longest_save)

    def stuck_after(self):
        """Seconds after SIGTERM by which this run, if not stuck, has stopped: three of its longest steps and two
        of its longest checkpoints, and never less than 10 s (signals.py ends the process then)."""
        return max(10, int(3 * self.longest_step + 2 * self.longest_checkpoint) + 1)

    # ------------------------------------------------------------ before training

    def on_train_start(self, trainer):
        self.first_step = trainer.global_step
        if self.runtime.is_main:
            (self.folder / NOTE_FILE).unlink(missing_ok=True)  # a note of an earlier stop is history now
        if self.deadline is not None or self.args.grace_period is not None:
            with fail_together(self.runtime):
                estimate = checkpoint_estimate(trainer, self.folder) if self.runtime.is_main else 0.0
            self.estimate = broadcast_number(estimate, self.runtime)
            with fail_together(self.runtime):
                self.check_grace_period()
                self.check_budget()
        self.last_boundary = time.perf_counter()
        if self.agree_now(self.wanted(trainer, before_training=True)):
            self.stop(trainer, self.agreed_code)

    def check_grace_period(self):
        grace, needed = self.args.grace_period, self.longest_checkpoint
        if grace is not None and needed > grace:
            raise CourseError(
                f"a checkpoint of this run takes about {needed:.1f} s here (written to {display_path(self.folder)}), "
                f"longer than the {grace:g} s between a scheduler's stop signal and its SIGKILL (--grace-period): "
                f"a stop could not save its step. Raise the grace period (PBS: the queue's kill_delay; Slurm: "
                f"KillWait, or an earlier --signal) or put --checkpoint-dir on a faster file system")

    def check_budget(self):
        if self.deadline is None:
            return
        left = self.deadline - time.time() - self.args.stop_margin - self.longest_checkpoint
        if left <= 0:
            start, _ = job_start()
            raise CourseError(
                f"--stop-after {clock(self.args.stop_after)} leaves no time for a step: {self.clock_start} "
                f"{time.time() - start:.1f} s ago, and a stop keeps {self.args.stop_margin:g} s (--stop-margin) and "
                f"about {self.longest_checkpoint:.1f} s for a checkpoint; ask for a longer walltime")

    # ------------------------------------------------------------ at each step boundary

    def on_step_end(self, trainer):
        now = time.perf_counter()
        self.longest_step = max(self.longest_step, now - self.last_boundary)
        self.last_boundary = now
        code = self.read_agreed()  # what every rank wanted one step ago
        if code >= NOT_FINITE:
            self.diverged(trainer)
        if code and trainer.batches_done >= trainer.epoch_batches:
            self.pending = code  # the epoch's last step: stop after its evaluation and checkpoint
        elif code:
            self.stop(trainer, code)
        else:
            self.post(self.wanted(trainer), trainer)

    def on_epoch_end(self, trainer, metrics):
        if self.pending and trainer.epoch <= self.args.epochs:  # after the last epoch there is nothing to stop
            self.stop(trainer, self.pending)

    def on_train_end(self, trainer):
        if self.read_agreed() >= NOT_FINITE:  # the last one in flight, so that no collective outlives training
            self.diverged(trainer)

    def wanted(self, trainer, before_training=False):
        """What this rank asks for now: a signal it got, a stop request, or the end of its time budget."""
        if received:
            return SIGNAL_BASE + received[0]
        if not before_training and trainer.global_step > self.first_step:  # a request waits for one step
            if self.runtime.is_main and (self.folder / REQUEST_FILE).exists():
                return REQUEST
            if self.deadline is not None and self.out_of_time():
                return BUDGET
        return NOTHING

    def out_of_time(self):
        """True when two more steps (the one that runs while the ranks agree, and one to spare), a checkpoint
        and the margin would not fit before the deadline."""
        needed = 2 * self.longest_step + self.longest_checkpoint + self.args.stop_margin
        return time.time() + needed > self.deadline

    # ------------------------------------------------------------ agreeing

    def post(self, code, trainer):
        """Start the all_reduce (MAX) of every rank's wish; ``read_agreed`` collects it at the next boundary.
        The wish is made on the device, where the step's loss is (torch.full is a kernel; torch.tensor from a
        list would copy from the host and wait for the GPU): NOT_FINITE if that loss is not finite (unless
        --train-through-nan). Read one step later, it lets the CPU run at most one step ahead of the GPU."""
        device = self.runtime.device
        wish = torch.full((1,), code, dtype=torch.int32, device=device)
        if trainer.step_loss is not None and not self.args.train_through_nan:
            wish = torch.where(trainer.step_loss.isfinite(), wish, NOT_FINITE)
        self.posted_at = (trainer.global_step, trainer.step_loss)
        work = dist.all_reduce(wish, op=dist.ReduceOp.MAX, async_op=True) if self.runtime.distributed else None
        if device.type == "cuda":
            if work is not None:
                work.wait()  # the stream waits for the collective; the CPU does not
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(wish, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.posted = (event, host)
        else:
            self.posted = (work, wish)

    def read_agreed(self):
        """The largest wish of the boundary before, which every rank reads alike (0 before the first)."""
        posted, self.posted = self.posted, None
        if posted is None:
            return NOTHING
        waiter, value = posted
        if isinstance(waiter, torch.cuda.Event):
            waiter.synchronize()
        elif waiter is not None:
            waiter.wait()
        return int(value.item())

    def agree_now(self, code):
        """Before training: every rank's wish, agreed at once."""
        self.agreed_code = code
        if self.runtime.distributed:
            wish = torch.tensor([code], dtype=torch.int32, device=self.runtime.device)
            dist.all_reduce(wish, op=dist.ReduceOp.MAX)
            self.agreed_code = int(wish.item())
        return self.agreed_code

    # ------------------------------------------------------------ stopping

    def diverged(self, trainer):
        """Some rank's loss was not finite at the step posted last: every rank stops now, saving nothing."""
        step, loss = self.posted_at
        losses = gather_from_all_ranks(float(loss))  # only on the way out: which rank's, and what
        raise self.checkpointing.failed(divergence.stopped(
            f"the training loss became {divergence.not_finite(losses)} at step {step}", trainer, self.folder))

    def stop(self, trainer, code):
        """The checkpoint of this step (unless the checkpointing callback just wrote it), a note for the job,
        one line, and the exit."""
        step = trainer.global_step
        progressed = step > self.first_step
        if progressed and self.checkpointing.saved_step != step:  # unless the checkpointing callback just saved it
            self.checkpointing.save(trainer)
        if self.runtime.is_main:
            self.tell(step, code, progressed, saved=self.checkpointing.saved_step == step)
        status = 0 if code < SIGNAL_BASE else 128 + code - SIGNAL_BASE
        raise Stopped(status)

    def tell(self, step, code, progressed, saved):
        if code == BUDGET:
            why = f"--stop-after {clock(self.args.stop_after)} would run out during the next steps"
        elif code == REQUEST:
            why = f"asked by {display_path(self.folder / REQUEST_FILE)}"
        else:
            why = reason_words(code)
        if code == REQUEST:
            (self.folder / REQUEST_FILE).unlink(missing_ok=True)  # the request is answered
        newest = checkpoints.checkpoints_in(self.folder)
        where = display_path(newest[-1]) if newest else None
        if progressed and not saved:  # --train-through-nan: no checkpoint of non-finite values, no note for the job
            print(f"stopped at step {step} ({why}) without its checkpoint (values not finite): the same command with "
                  f"--resume continues from {where}", flush=True)
        elif progressed:
            (self.folder / NOTE_FILE).write_text(f"{reason_words(code)} {step}\n")
            print(f"stopped at step {step} ({why}), checkpoint written, resumable: the same command with --resume "
                  f"continues from {where}", flush=True)
        elif where:
            print(f"stopped before training ({why}): nothing new to save, resumable: the same command with --resume "
                  f"continues from {where}", flush=True)
        else:
            print(f"stopped before training ({why}): nothing trained, nothing saved", flush=True)


def checkpoint_estimate(trainer, folder):
    """Seconds a checkpoint of this run would take, measured: the model's weights serialized and written
    (fsync'ed) into the checkpoint folder, times the copies a checkpoint holds (checkpoints.COPIES)."""
    model = unwrap(trainer.model)
    copies = checkpoints.COPIES.get(trainer.args.optimizer, 3)
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".checkpoint-time-probe-{os.getpid()}"
    started = time.perf_counter()
    try:
        checkpoints.write_atomically(model.state_dict(), probe)
    finally:
        probe.unlink(missing_ok=True)
    return copies * (time.perf_counter() - started)


def broadcast_number(value, runtime):
    """Rank 0's ``value``, on every rank."""
    if not runtime.distributed:
        return value
    number = torch.tensor([value], dtype=torch.float64, device=runtime.device)
    dist.broadcast(number, src=0)
    return float(number.item())


def note(folder):
    """(reason, step) from a stopped run's note in ``folder``, or None: what the job scripts read."""
    path = Path(folder) / NOTE_FILE
    if not path.is_file():
        return None
    reason, step = path.read_text().split()
    return reason, int(step)
