"""Which rank fell behind, when a collective fails: the straggler watch. Machinery: a learner may skip this
module (notebook 05 shows it at work).

Without it, a rank whose collective times out can only say "timed out". With it, the line names the rank
that stalled or died and what it last did: ``cli.run`` asks the watch of this process to explain a failed
collective (``explain``).
"""
import atexit
import datetime
import os
import threading
import time

import torch.distributed as dist

from kit.errors import first_line
from lesson.loop import Callback

ACTIVE = []  # the watch of this process, once a Trainer has one: what cli.run asks


class StragglerWatch(Callback):
    """Where each rank is, posted to the job's key-value store, so that a rank whose collective fails can say
    which rank fell behind or died, instead of only "timed out".

    A rank's position is the steps it has completed and what it has done since: a phase of ``PHASES``, in the
    order a step goes through them (the waiter of a collective in step N+1 is "training" after N steps; a rank
    that stopped after step N is still "between steps"). Any rank whose position is behind the waiter's never
    reached the collective the waiter is stuck in.

    ``post`` only notes the position in memory: a training step pays an assignment for it. A thread writes it
    to the store whenever it has changed, at most every ``INTERVAL`` seconds, whatever the main thread is doing
    (computing, waiting in a collective, asleep). So a rank that stopped anywhere has its true position in the
    store within ``INTERVAL``, long before any --timeout ends the wait, however long a step takes. The store is
    the one every rank already shares: torchrun's, at MASTER_ADDR:MASTER_PORT.
    """

    INTERVAL = 0.25  # seconds between writes at most: a few tiny writes a second, far below any --timeout
    PHASES = ("starting", "between steps", "ending the epoch", "training", "finished")

    def __init__(self, runtime):
        self.runtime = runtime
        self.store = None
        self.position = (0, "starting", time.time())  # steps done, phase, since when
        self.written = None
        self.lock = threading.Lock()  # one connection to the store, shared by the writer thread and explain
        self.stopped = threading.Event()
        self.writer = None
        if runtime.world_size > 1:
            try:
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=datetime.timedelta(seconds=10))
            except (RuntimeError, KeyError, ValueError):
                self.store = None  # diagnosis only: training does not depend on it
        if self.store is not None:
            self.writer = threading.Thread(target=self.keep_writing, name="course-straggler-watch", daemon=True)
            self.writer.start()
            atexit.register(self.close)  # stopped before the interpreter shuts down, never in the middle of a write
        ACTIVE.append(self)

    # ------------------------------------------------------------ the loop's points

    def on_train_start(self, trainer):
        self.post(trainer.global_step, "starting", now=True)

    def on_step_start(self, trainer):
        self.post(trainer.global_step, "training")  # before the step's first collective

    def on_step_end(self, trainer):
        self.post(trainer.global_step, "between steps")

    def on_evaluation_start(self, trainer):
        self.post(trainer.global_step, "ending the epoch")

    def on_train_end(self, trainer):
        self.post(trainer.global_step, "finished", now=True)
        self.close()

    # ------------------------------------------------------------ the store

    @staticmethod
    def key(rank):
        return f"course/progress/{rank}"

    def post(self, step, phase, now=False):
        """This rank has completed ``step`` steps and is ``phase`` (one of PHASES) since.

        ``now``: write it to the store before returning (at the start and the end), instead of within INTERVAL.
        """
        if (step, phase) != self.position[:2]:
            self.position = (step, phase, time.time())
        if now:
            self.write()

    def write(self):
        """Write this rank's position to the store, if it changed since the last write."""
        with self.lock:
            position = self.position
            if self.store is None or position == self.written:
                return
            step, phase, since = position
            try:
                self.store.set(self.key(self.runtime.rank), f"{step} {since:.3f} {phase}")
                self.written = position
            except RuntimeError:
                self.store = None  # the store is gone: the job is ending

    def keep_writing(self):
        while not self.stopped.wait(self.INTERVAL) and self.store is not None:
            self.write()

    def close(self):
        """Stop the writer thread (its last change written first)."""
        if self.writer is not None and not self.stopped.is_set():
            self.stopped.set()
            self.writer.join(timeout=2 * self.INTERVAL)
            self.write()

    def others(self):
        """[(rank, steps done, seconds in its phase, phase)] of every other rank, where known."""
        seen = []
        with self.lock:
            if self.store is None:
                return []
            for rank in range(self.runtime.world_size):
                if rank == self.runtime.rank:
                    continue
                try:
                    if not self.store.check([self.key(rank)]):
                        seen.append((rank, None, None, "never reported"))
                        continue
                    step, since, phase = self.store.get(self.key(rank)).decode().split(" ", 2)
                    seen.append((rank, int(step), time.time() - float(since), phase))
                except (RuntimeError, ValueError):
                    return seen  # the store itself is gone: the job is ending
        return seen

    def behind(self, step, phase):
        """True when a rank at (step, phase) cannot have reached the collective this rank waits in.
        A finished rank joins no collective any more; a phase this code does not know is reported too."""
        mine = (self.position[0], self.PHASES.index(self.position[1]))
        if phase == "finished" or phase not in self.PHASES:
            return True
        return (step, self.PHASES.index(phase)) < mine

    def explain_collective_failure(self, error):
        """One line: what happened to this rank's collective, at the step it is in, and who seems to be behind."""
        step, text = self.position[0], first_line(error)
        if "Timed out" in text or "timeout" in text.lower():
            what = f"waited longer than --timeout {self.runtime.timeout.total_seconds():.0f} s in a collective"
        else:
            what = f"lost a peer in a collective ({text})"
        laggards = [f"rank {rank} last reported step {s} {age:.0f} s ago ({phase})" if s is not None
                    else f"rank {rank} {phase}"
                    for rank, s, age, phase in self.others() if s is None or self.behind(s, phase)]
        who = "; ".join(laggards) if laggards else "the other ranks' progress is unknown; their logs say why"
        return (f"rank {self.runtime.rank} {what} at step {step}: {who}. A stalled or dead rank stops every rank; "
                f"look at its log first")


def is_collective_failure(error):
    """True for the errors a collective raises when a peer stalls or dies (gloo and NCCL)."""
    if isinstance(error, dist.DistBackendError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("Timed out", "Connection closed by peer", "Connection reset by peer",
                                      "Socket Timeout"))


def explain(error):
    """One line that says which rank fell behind, from this process's watch; None without one."""
    return ACTIVE[-1].explain_collective_failure(error) if ACTIVE else None
