"""Stopping a run on purpose, with nothing lost: every rank stops at the same step, with a checkpoint of it.
Machinery: a learner may skip this module (notebook 05 and docs/running_on_a_cluster.md show it at work).

Three things ask a run to stop before its last epoch:

- a signal: SIGTERM (a scheduler at the walltime or on qdel/scancel, torchrun forwarding its own),
  SIGINT (Ctrl-C; a second one stops at once) or SIGUSR1 (Slurm's ``--signal`` warning);
- its time budget, ``--stop-after``: the run stops when the next steps and a checkpoint would no longer
  fit before it (the PBS jobs pass the walltime they were granted);
- a stop request: a file named ``STOP`` in the checkpoint folder (the Slurm jobs write it when the
  warning signal reaches the job shell; anyone may write it by hand).

A signal only sets a flag (``install_handlers``, which ``cli.run`` calls before anything else). At every
step boundary each rank posts what it wants, and the ranks agree with one all_reduce (MAX) on a tiny
tensor, read one step later so that the GPU never waits for it: every rank stops after the same step, and
no rank saves a step the others did not take. The checkpointing callback writes that step's checkpoint,
rank 0 leaves a note in the folder (``STOPPED``: the reason and the step, for the job scripts) and prints
one line, and the process exits: status 0 when the run was asked to stop by its budget or a stop request
(torchrun must not restart it), 128 + the signal's number after a signal.
"""
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lesson.loop import Callback
from lesson.models import unwrap

from kit import checkpoints
from kit.agreement import fail_together
from kit.errors import CourseError
from kit.output_paths import display_path

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
received = []  # the signals this process got, in order: a handler only appends here
GRACE = []  # --grace-period, once known: how long after SIGTERM the scheduler sends SIGKILL
ACTIVE = []  # the GracefulStop of this process, once a Trainer has one: how long its steps and checkpoints take

REQUEST_FILE = "STOP"  # in the checkpoint folder: "stop at the next step" (the Slurm jobs write it)
NOTE_FILE = "STOPPED"  # in the checkpoint folder: "<reason> <step>", written by rank 0 after a stop

# What a rank posts at a step boundary; the largest wins: a signal, then a request, then the budget.
NOTHING, BUDGET, REQUEST, SIGNAL_BASE = 0, 1, 2, 16


class Stopped(Exception):
    """Raised after the stop's checkpoint is written; cli.run exits with ``status``."""

    def __init__(self, status):
        super().__init__(f"stopped with status {status}")
        self.status = status


def install_handlers(grace=None):
    """Signals set a flag; the run acts on it at its next step boundary. A second Ctrl-C stops at once.

    SIGTERM also sets a limit: a process that has not stopped by then ends itself (SIGALRM), as SIGTERM alone
    would have ended it. It is one second before the scheduler's SIGKILL is due, with ``grace``
    (--grace-period): on PBS that SIGKILL reaches torchrun but not its workers, which live in sessions of
    their own, so a worker stuck in a collective would otherwise outlive its job. Without it, the limit is
    ``stuck_after()``: a rank stuck where no step ends (a collective whose peer died, a hung file system) is
    not kept waiting for torchrun's SIGKILL, 30 s later, before its group can restart."""
    GRACE[:] = [grace] if grace else []
    for number in SIGNALS:
        signal.signal(number, on_signal)
    watch_for_sigterm()


def on_signal(number, frame):
    if number == signal.SIGINT and signal.SIGINT in received:
        raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step to end
    if number == signal.SIGTERM:
        arm_alarm()  # as watch_for_sigterm's thread does: whichever comes first sets it
    received.append(number)


WAKEUP = []  # the socket pair of watch_for_sigterm, kept open for the life of the process


def watch_for_sigterm():
    """Arm the alarm the moment SIGTERM arrives, even while the main thread cannot run Python code.

    Python runs ``on_signal`` in the main thread, between two bytecodes: not until a collective returns (or
    fails at --timeout) when that thread waits inside torch's C++ for a peer that stalled, and not until a sleep
    or other blocking call ends when the signal came just before it began. Python's own C-level handler, though,
    writes the signal's number at once to the "wakeup fd" (signal.set_wakeup_fd); a thread of ours waits on that
    socket and arms the alarm. It needs the GIL, which torch releases while it waits, as sleep and I/O do. A
    process forked from this one (a DataLoader worker) stops writing to it."""
    if WAKEUP:
        return  # one watcher per process
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    WAKEUP[:] = [reader, writer]  # set_wakeup_fd keeps only the number: a closed socket's could be reused
    signal.set_wakeup_fd(writer.fileno())
    os.register_at_fork(after_in_child=lambda: signal.set_wakeup_fd(-1))
    threading.Thread(target=arm_alarm_on_sigterm, args=(reader,), name="sigterm-alarm", daemon=True).start()


def arm_alarm_on_sigterm(reader):
    while data := reader.recv(64):
        if signal.SIGTERM in data:
            arm_alarm()


# Held once the alarm is set: the first SIGTERM sets it, a later one never moves it. Never waited for (it is
# taken from a signal handler too, where waiting on a lock could deadlock).
ALARM_ARMED = threading.Lock()


def arm_alarm():
    """SIGALRM, whose default action ends the process, at the limit ``install_handlers`` describes."""
    if ALARM_ARMED.acquire(blocking=False):
        signal.alarm(max(1, int(GRACE[0]) - 1) if GRACE else stuck_after())


def stop_signal():
    """The name of the first signal received that ends a run (not SIGUSR1, a warning), or None."""
    ending = [number for number in received if number != signal.SIGUSR1]
    return signal.Signals(ending[0]).name if ending else None


def stuck_after():
    """Seconds after SIGTERM by which a run that is not stuck has stopped: three of its longest steps and two of
    its longest checkpoints, and never less than 10 s."""
    if not ACTIVE:
        return 10
    return max(10, int(3 * ACTIVE[-1].longest_step + 2 * ACTIVE[-1].longest_checkpoint) + 1)


def job_start():
    """(when the clock of --stop-after started, in words): the job's start if the job scripts said when
    (COURSE_JOB_START, seconds since 1970), else this process's start."""
    text = os.environ.get("COURSE_JOB_START", "")
    try:
        return float(text), "the job started (COURSE_JOB_START)"
    except ValueError:
        return process_start(), "this run started"


def process_start():
    """When this process started, in seconds since 1970 (Linux: /proc; elsewhere: when this module loaded)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return LOADED


LOADED = time.time()


def duration(text):
    """'90', '1:30' or '1:30:00' (PBS's and Slurm's walltime formats) -> seconds."""
    parts = text.split(":")
    if len(parts) > 3 or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"{text!r} is not a duration: give seconds, or [[H:]M:]S as in a walltime")
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    if seconds <= 0:
        raise ValueError(f"{text!r}: the duration must be positive")
    return seconds


def clock(seconds):
    """3725 -> '1:02:05'."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def reason_words(code):
    if code >= SIGNAL_BASE:
        return signal.Signals(code - SIGNAL_BASE).name
    return {BUDGET: "time-budget", REQUEST: "stop-request"}[code]


class GracefulStop(Callback):
    """Stop every rank after the same step, with a checkpoint of that step, when asked to (see above)."""

    def __init__(self, args, runtime, checkpointing):
        self.args, self.runtime, self.checkpointing = args, runtime, checkpointing
        self.folder = checkpointing.folder
        self.deadline = None
        if args.stop_after is not None:
            start, self.clock_start = job_start()
            self.deadline = start + args.stop_after
        self.longest_step = 0.0  # seconds between two step ends, the evaluation included at an epoch's end
        self.longest_checkpoint = 0.0  # seconds a checkpoint took (before the first one: the estimate)
        self.last_boundary = None
        self.saved_step = None  # the step of the newest checkpoint this run wrote
        self.first_step = None  # where this run started (a resumed run: the checkpoint's step)
        self.posted = None  # the all_reduce in flight: (work, tensor, event)
        self.pending = NOTHING  # an agreed stop that waits for the epoch's end
        self.save = checkpointing.save
        checkpointing.save = self.timed_save  # every checkpoint is timed, and its step noted
        ACTIVE.append(self)

    def timed_save(self, trainer):
        started = time.perf_counter()
        self.save(trainer)
        self.longest_checkpoint = max(self.longest_checkpoint, time.perf_counter() - started)
        self.saved_step = trainer.global_step

    # ------------------------------------------------------------ before training

    def on_train_start(self, trainer):
        self.first_step = trainer.global_step
        if self.runtime.is_main:
            (self.folder / NOTE_FILE).unlink(missing_ok=True)  # a note of an earlier stop is history now
        if self.deadline is not None or self.args.grace_period is not None:
            with fail_together(self.runtime):
                estimate = checkpoint_estimate(trainer, self.folder) if self.runtime.is_main else 0.0
            self.longest_checkpoint = max(broadcast_number(estimate, self.runtime), self.longest_checkpoint)
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
        if code and trainer.batches_done >= trainer.epoch_batches:
            self.pending = code  # the epoch's last step: stop after its evaluation and checkpoint
        elif code:
            self.stop(trainer, code)
        else:
            self.post(self.wanted(trainer))

    def on_epoch_end(self, trainer, metrics):
        if self.pending and trainer.epoch <= self.args.epochs:  # after the last epoch there is nothing to stop
            self.stop(trainer, self.pending)

    def on_train_end(self, trainer):
        self.read_agreed()  # the last one in flight, so that no collective outlives training

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

    def post(self, code):
        """Start the all_reduce (MAX) of every rank's wish; ``read_agreed`` collects it at the next boundary."""
        if not self.runtime.distributed:
            self.posted = code
            return
        device = self.runtime.device
        wish = torch.tensor([code], dtype=torch.int32, device=device)
        work = dist.all_reduce(wish, op=dist.ReduceOp.MAX, async_op=True)
        if device.type == "cuda":
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
        if isinstance(posted, int):
            return posted
        waiter, value = posted
        if isinstance(waiter, torch.cuda.Event):
            waiter.synchronize()
        else:
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

    def stop(self, trainer, code):
        """The checkpoint of this step (unless the checkpointing callback just wrote it), a note for the job,
        one line, and the exit."""
        step = trainer.global_step
        progressed = step > self.first_step
        if progressed and self.saved_step != step:
            self.checkpointing.save(trainer)
        if self.runtime.is_main:
            self.tell(step, code, progressed)
        status = 0 if code < SIGNAL_BASE else 128 + code - SIGNAL_BASE
        raise Stopped(status)

    def tell(self, step, code, progressed):
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
        if progressed:
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
    (fsync'ed) into the checkpoint folder, times the copies a checkpoint holds (the weights and the optimizer's
    state per parameter: Adam and Adadelta keep two, SGD with momentum one)."""
    model = unwrap(trainer.model)
    copies = 1 + {"adam": 2, "adadelta": 2, "sgd": 1}.get(trainer.args.optimizer, 2)
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


def finish(error):
    """cli.run's answer to Stopped: the line was printed; exit with its status."""
    sys.stdout.flush()
    sys.exit(error.status)


def note(folder):
    """(reason, step) from a stopped run's note in ``folder``, or None: what the job scripts read."""
    path = Path(folder) / NOTE_FILE
    if not path.is_file():
        return None
    reason, step = path.read_text().split()
    return reason, int(step)
