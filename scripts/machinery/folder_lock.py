"""One run per checkpoint folder: a run takes the folder before training and gives it back on its way out.
Machinery: a learner may skip this module.

Two runs training into one folder (a job submitted twice, a follow-up started while the first still runs)
would resume from each other's half-written steps. So rank 0 creates ``LOCK`` in the folder before the
resume decision: one line of JSON naming its host, pid and scheduler job, made in one step (written beside
it, then hard-linked to the name, which fails when the name exists: atomic on local file systems and NFS).
A second run finds it and stops before training with one line naming the holder.

A lock is given back on every way out Python sees (the end of training, an error, a stop, an exit). One
left by a run that died (SIGKILL, a lost node) is stale, and the next run takes it over, when:
- it names this host and its process is gone (a pid and the process's start time, so a reused pid does not
  count): torchrun's restart of the same run, a follow-up on the same node;
- it names another host and the same scheduler job (PBS_JOBID, SLURM_JOB_ID): a requeued or rerun job, or
  a torchrun restart that moved rank 0, as a scheduler runs one copy of a job at a time;
- it names another host and shows no sign of life for ``STALE_AFTER`` seconds: its holder refreshes the
  file's time every ``HEARTBEAT`` seconds from a thread, so a node that died stops refreshing it (this
  compares the file server's clock with this node's: they agree within seconds where NTP runs);
- it names another host and a job the scheduler says has ended (qstat, squeue: kit/schedulers.py), such
  as the job before a resubmitted one, where this node can ask.
"""
import atexit
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from kit import checkpoints, schedulers
from kit.agreement import fail_together
from kit.errors import CourseError
from kit.output_paths import check_folder, display_path
from lesson.loop import Callback

NAME = "LOCK"
HEARTBEAT = 15  # seconds between two refreshes of the lock file's time
STALE_AFTER = 120  # seconds without a refresh after which another node's lock is stale


class OneRunPerFolder(Callback):
    """Rank 0 takes ``folder`` before the resume decision; every rank stops with its line if it is held."""

    def __init__(self, runtime, folder):
        self.runtime, self.folder, self.lock = runtime, Path(folder), None

    def on_train_start(self, trainer):
        with fail_together(self.runtime):
            if self.runtime.is_main:
                check_folder(self.folder, "--checkpoint-dir")
                self.lock = take(self.folder)

    def on_train_end(self, trainer):
        if self.lock is not None:
            self.lock.release()


def this_process():
    """What a lock says of its holder."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid()),
            "job": scheduler_job(), "token": uuid.uuid4().hex, "since": time.time()}


def scheduler_job():
    """'PBS 12.head', 'Slurm 345', or None outside a scheduler's job."""
    for variable, scheduler in (("PBS_JOBID", "PBS"), ("SLURM_JOB_ID", "Slurm")):
        if os.environ.get(variable):
            return f"{scheduler} {os.environ[variable]}"
    return None


def process_start(pid):
    """The process's start time in clock ticks since boot (Linux), to tell it from a later one with its pid;
    "ended" for a zombie (killed, not yet reaped: a container's first process may never reap it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return "ended" if fields[0] == "Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def is_running(holder):
    """Whether the process a lock names still runs on this host."""
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    started = process_start(holder["pid"])
    return started != "ended" and (started is None or holder.get("started") is None or started == holder["started"])


def why_stale(holder, age):
    """Why a lock may be taken over, or None while its holder may still run."""
    if holder["host"] == socket.gethostname():
        if holder["pid"] == os.getpid():
            return "an earlier run in this process, which has ended"
        return None if is_running(holder) else f"its process {holder['pid']} has ended"
    if holder.get("job") and holder["job"] == scheduler_job():
        return f"it is this job's ({holder['job']}), from before a restart or requeue"
    if age > STALE_AFTER:
        return f"no sign of life from {holder['host']} for {age:.0f} s"
    if holder.get("job") and schedulers.job_ended(holder["job"]):
        return f"its job, {holder['job']}, has ended (the scheduler says so)"
    return None


class Lock:
    def __init__(self, path, holder):
        self.path, self.holder = path, holder
        self.stopped = threading.Event()
        threading.Thread(target=self.refresh, name="folder-lock", daemon=True).start()
        atexit.register(self.release)

    def refresh(self):
        while not self.stopped.wait(HEARTBEAT):
            try:
                os.utime(self.path)
            except OSError:
                return  # gone: nothing left to keep alive

    def release(self):
        """Remove the lock, if it is still this run's (and this is its process, not a forked DataLoader worker)."""
        self.stopped.set()
        atexit.unregister(self.release)
        if os.getpid() == self.holder["pid"] and read(self.path) == self.holder:
            self.path.unlink(missing_ok=True)


def take(folder):
    """This process's lock on ``folder``, or a CourseError naming the run that holds it."""
    path = Path(folder) / NAME
    mine = this_process()
    for _ in range(3):  # another run may take a stale lock at the same moment: look again
        if create(path, mine):
            checkpoints.remove_partials(folder)  # the folder is this run's now: no writer of before is at work
            return Lock(path, mine)
        holder = read(path)
        if holder is None:
            continue  # released in the meantime
        age = time.time() - modified(path)
        reason = why_stale(holder, age)
        if reason is None:
            raise held(folder, holder, age)
        if read(path) == holder:  # not taken over by another run in the meantime
            path.unlink(missing_ok=True)
            print(f"took over {display_path(path)} from pid {holder['pid']} on {holder['host']}: {reason}",
                  flush=True)
    raise CourseError(f"{display_path(path)} changed hands while this run tried to take it: is another run "
                      f"starting on --checkpoint-dir {display_path(folder)}? Start one run per folder")


def create(path, holder):
    """Make ``path`` hold ``holder``, whole, unless it exists: True if this call made it."""
    draft = path.with_name(f".{NAME}.{holder['token']}")
    draft.write_text(json.dumps(holder) + "\n")
    try:
        os.link(draft, path)  # fails if the lock exists; the file is complete the moment it has the name
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: create it exclusively, then fill it
        try:
            with open(path, "x") as file:
                file.write(json.dumps(holder) + "\n")
            return True
        except FileExistsError:
            return False
    finally:
        draft.unlink(missing_ok=True)


def read(path):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # being filled on a file system without hard links
        return {"host": "?", "pid": 0}


def modified(path):
    try:
        return Path(path).stat().st_mtime
    except FileNotFoundError:
        return time.time()


def held(folder, holder, age):
    job = f", {holder['job']}" if holder.get("job") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return CourseError(
        f"--checkpoint-dir {display_path(folder)} is in use by another run (pid {holder['pid']} on {holder['host']}"
        f"{job}, since {since}, alive {age:.0f} s ago): wait for it to end, or give this run another "
        f"--checkpoint-dir. A lock its holder left by dying is taken over at once on the same node or once the "
        f"scheduler says its job ended, else after {STALE_AFTER} s without a sign of life; or delete "
        f"{display_path(Path(folder) / NAME)} once that run has surely ended")
