"""What a signal does to this process: it only asks for a stop, which the run makes at its next step boundary
(graceful_stop.py). Machinery: a learner may skip this module.

``cli.run`` installs the handlers before anything else. SIGTERM (a scheduler at the walltime or on qdel/scancel,
torchrun forwarding its own), SIGINT (Ctrl-C; a second one stops at once) and SIGUSR1 (Slurm's ``--signal``
warning) are noted in ``received``. SIGTERM also arms a limit (SIGALRM), so that a process stuck where no step
ends does not outlive its job. SIGUSR2 only prints every thread's stack (``dump_stacks_on_sigusr2``)."""
import faulthandler
import os
import signal
import socket
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
received = []  # the signals this process got, in order: a handler only appends here
GRACE = []  # --grace-period, once known: how long after SIGTERM the scheduler sends SIGKILL
STUCK_AFTER = []  # what gives the seconds after SIGTERM by which a run that is not stuck has stopped
WAKEUP = []  # the socket pair of watch_for_sigterm, kept open for the life of the process
# Held once the alarm is set: the first SIGTERM sets it, a later one never moves it. Never waited for (it is
# taken from a signal handler too, where waiting on a lock could deadlock).
ALARM_ARMED = threading.Lock()


class Stopped(Exception):
    """Raised after a stop's checkpoint is written; cli.run exits with ``status`` (``finish``)."""

    def __init__(self, status):
        super().__init__(f"stopped with status {status}")
        self.status = status


def install_handlers():
    """Signals set a flag; the run acts on it at its next step boundary. A second Ctrl-C stops at once.

    SIGTERM also sets a limit: a process that has not stopped by then ends itself (SIGALRM), as SIGTERM alone would have
    ended it. It is one second before the scheduler's SIGKILL is due, with ``grace`` (--grace-period): on PBS that
    SIGKILL reaches torchrun but not its workers, which live in sessions of their own, so a worker stuck in a collective
    would otherwise outlive its job. Without it, the limit is what the graceful stop says when SIGTERM comes
    (``set_stuck_after``), else 10 s: a rank stuck where no step ends (a collective whose peer died, a hung file system)
    is not kept waiting for torchrun's SIGKILL, 30 s later, before its group can restart. Installed before the flags are
    parsed, so that a signal during the parse is noted too; ``set_grace`` passes --grace-period on once it is known."""
    for number in SIGNALS:
        signal.signal(number, on_signal)
    dump_stacks_on_sigusr2()
    watch_for_sigterm()


def set_grace(grace):
    """--grace-period, the seconds between the scheduler's SIGTERM and its SIGKILL (None: not known)."""
    GRACE[:] = [grace] if grace else []


def set_stuck_after(stuck_after):
    """``stuck_after()``: the limit after SIGTERM when no --grace-period is known, asked when SIGTERM comes (the
    graceful stop gives it from the run's longest step and checkpoint so far)."""
    STUCK_AFTER[:] = [stuck_after]


def on_signal(number, frame):
    if number == signal.SIGINT and signal.SIGINT in received:
        raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step to end
    if number == signal.SIGTERM:
        arm_alarm()  # as watch_for_sigterm's thread does: whichever comes first sets it
    received.append(number)


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


def dump_stacks_on_sigusr2():
    """``kill -USR2 PID`` prints the Python stack of every thread of the process to its stderr, and the run goes
    on: what ``py-spy dump`` shows, for a hung rank where ptrace is refused (faulthandler's handler is C code, so
    it prints even while the main thread waits inside a collective). Not SIGUSR1, which asks for a stop."""
    if sys.__stderr__ is not None:  # None: a process started without stderr
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)


def arm_alarm():
    """SIGALRM, whose default action ends the process, at the limit ``install_handlers`` describes."""
    if ALARM_ARMED.acquire(blocking=False):
        signal.alarm(max(1, int(GRACE[0]) - 1) if GRACE else stuck_after())


def stuck_after():
    """Seconds after SIGTERM by which a run that is not stuck has stopped: the graceful stop's answer, else 10."""
    return STUCK_AFTER[-1]() if STUCK_AFTER else 10


def stop_signal():
    """The name of the first signal received that ends a run (not SIGUSR1, a warning), or None."""
    ending = [number for number in received if number != signal.SIGUSR1]
    return signal.Signals(ending[0]).name if ending else None


def finish(stopped):
    """cli.run's answer to Stopped: the line was printed; exit with its status."""
    sys.stdout.flush()
    sys.exit(stopped.status)
