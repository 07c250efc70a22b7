"""One run per checkpoint folder: a run takes the folder before training and gives it back on its way out.
Machinery: a learner may skip this module.

Two runs training into one folder (a job submitted twice, a follow-up started while the first still runs)
would resume from each other's half-written steps. So rank 0 creates ``LOCK`` in the folder before the
resume decision (resume.py): one line of JSON naming its host, pid and scheduler job, made in one step
(written beside it, then hard-linked to the name, which fails when the name exists: atomic on local file
systems and NFS). A second run finds it and stops before training with one line naming the holder.

A lock is given back at the end of training and on every way out of ``cli.run`` (an error, a stop), else
at the interpreter's exit. One left by a run that died (SIGKILL, a lost node) is stale, and the next run
takes it over, when:
- it names this machine (host name, boot and pid namespace: a container with the node's host name is
  another machine) and its process is gone (a pid and its start time, so a reused pid does not count):
  torchrun's restart of the same run, a follow-up on the same node;
- it names another machine and another incarnation of this scheduler job (PBS_JOBID, SLURM_JOB_ID, with
  the job's start, COURSE_JOB_START, Slurm's restart count and torchrun's): a rerun or requeued job, or a
  torchrun restart that moved rank 0;
- it names a job the scheduler says has ended (qstat, squeue: kit/schedulers.py), where this node can ask:
  the job before a resubmitted one;
- it shows no sign of life for ``STALE_AFTER`` seconds: its holder refreshes the file's time every
  ``HEARTBEAT`` seconds from a thread, so a node that died stops refreshing it (this compares the file
  server's clock with this node's: they agree within seconds where NTP runs).
A holder that finds its lock taken over (it was stopped or cut off for longer than that) stops at its next
checkpoint rather than write into a folder another run now holds.
"""
import atexit
import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from kit import checkpoints, schedulers
from kit.errors import CourseError
from kit.output_paths import display_path

NAME = "LOCK"
HEARTBEAT = 15  # seconds between two refreshes of the lock file's time
STALE_AFTER = 120  # seconds without a refresh after which a lock is stale
HELD = []  # the locks this process holds, for release_all
NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP)  # what os.link says on a file system without them


def this_process():
    """What a lock says of its holder."""
    return {"host": socket.gethostname(), "machine": machine(), "pid": os.getpid(),
            "started": process_start(os.getpid()), "job": scheduler_job(), "incarnation": incarnation(),
            "token": uuid.uuid4().hex, "since": time.time()}


def machine():
    """This boot of this machine, as one pid namespace sees it: where a pid means the same process."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(path).read_text().strip() if "boot_id" in path else os.readlink(path))
        except OSError:
            parts.append(None)
    return parts


def scheduler_job():
    """'PBS 12.head', 'Slurm 345', or None outside a scheduler's job."""
    for variable, scheduler in (("PBS_JOBID", "PBS"), ("SLURM_JOB_ID", "Slurm")):
        if os.environ.get(variable):
            return f"{scheduler} {os.environ[variable]}"
    return None


def incarnation():
    """What tells one run of a job from the next: the job script's start, Slurm's and torchrun's restart counts."""
    return [os.environ.get(name) for name in ("COURSE_JOB_START", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]


def process_start(pid):
    """The process's start time in clock ticks since boot (Linux), to tell it from a later one with its pid;
    "ended" for a zombie (killed, not yet reaped: a container's first process may never reap it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return "ended" if fields[0] == "Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def is_running(holder):
    """Whether the process a lock names still runs on this machine."""
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
    if holder["host"] == socket.gethostname() and holder.get("machine") == machine():
        if holder["pid"] == os.getpid():
            return "an earlier run in this process, which has ended"
        return None if is_running(holder) else f"its process {holder['pid']} has ended"
    if holder.get("job") and holder["job"] == scheduler_job() and holder.get("incarnation") != incarnation():
        return f"it is this job's ({holder['job']}) from before a restart or requeue"
    if age > STALE_AFTER:
        return f"no sign of life from {holder['host']} for {age:.0f} s"
    if holder.get("job") and holder["job"] != scheduler_job() and schedulers.job_ended(holder["job"]):
        return f"its job, {holder['job']}, has ended (the scheduler says so)"
    return None


class Lock:
    def __init__(self, path, holder):
        self.path, self.holder = path, holder
        self.taken_by = None  # who took it over, if another run did
        self.stopped = threading.Event()
        threading.Thread(target=self.refresh, name="folder-lock", daemon=True).start()
        HELD.append(self)
        atexit.register(self.release)

    def refresh(self):
        while not self.stopped.wait(HEARTBEAT):
            if self.other_holder() is not None:
                return  # taken over: check() says so before the next write
            with contextlib.suppress(OSError):  # a file server's hiccup (ESTALE, EIO): again at the next beat
                os.utime(self.path)

    def other_holder(self):
        """The run that took this lock over, or None while it is this run's (or cannot be read just now)."""
        try:
            now = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # gone for a moment (another run setting a stale lock aside) or unreadable: not a takeover
        if isinstance(now, dict) and now.get("token") not in (None, self.holder["token"]):
            self.taken_by = now
        return self.taken_by

    def check(self):
        """Raise if another run took this lock over (this run was stopped or cut off for longer than STALE_AFTER)."""
        taken_by = self.other_holder()
        if taken_by is not None:
            raise CourseError(f"another run (pid {taken_by.get('pid')} on {taken_by.get('host')}) took over "
                              f"{display_path(self.path)} while this run was stopped or cut off from it: this run "
                              f"stops rather than write into a folder another run holds")

    def release(self):
        """Remove the lock, if it is still this run's (and this is its process, not a forked DataLoader worker)."""
        self.stopped.set()
        atexit.unregister(self.release)
        if self in HELD:
            HELD.remove(self)
        if os.getpid() == self.holder["pid"] and read(self.path) == self.holder:
            with contextlib.suppress(OSError):  # on the way out: never a traceback instead of the run's own line
                self.path.unlink(missing_ok=True)


def release_all():
    """Every lock this process holds (cli.run's way out, whatever ended the run)."""
    for lock in list(HELD):
        lock.release()


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
        if set_aside(path, holder):
            print(f"took over {display_path(path)} from pid {holder['pid']} on {holder['host']}: {reason}",
                  flush=True)
    raise CourseError(f"{display_path(path)} changed hands while this run tried to take it: is another run "
                      f"starting on --checkpoint-dir {display_path(folder)}? Start one run per folder")


def set_aside(path, stale):
    """Remove the stale lock ``stale``, and only it: renamed first (one run alone can rename it), then checked."""
    aside = path.with_name(f".{NAME}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another run took it over first
    ours = read(aside) == stale
    if not ours:  # another run's fresh lock, made since we read the stale one: put it back
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    aside.unlink(missing_ok=True)
    return ours


def create(path, holder):
    """Make ``path`` hold ``holder``, whole, unless it exists: True if this call made it."""
    draft = path.with_name(f".{NAME}.{holder['token']}")
    try:
        draft.write_text(json.dumps(holder) + "\n")
        os.link(draft, path)  # fails if the lock exists; the file is complete the moment it has the name
        return True
    except FileExistsError:
        return False
    except OSError as error:
        if error.errno not in NO_HARD_LINKS:
            raise CourseError(f"--checkpoint-dir {display_path(path.parent)}: its lock file cannot be written "
                              f"({error.strerror}): put --checkpoint-dir on a file system with room (a scratch "
                              f"folder) that you can write to") from None
        try:  # a file system without hard links: create it exclusively, then fill it
            with open(path, "x") as file:
                file.write(json.dumps(holder) + "\n")
            return True
        except FileExistsError:
            return False
    finally:
        draft.unlink(missing_ok=True)


def read(path):
    """The holder a lock names, None if there is none; one that cannot be read names an unknown holder."""
    try:
        holder = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # being filled on a file system without hard links, or not a lock of the course
        holder = None
    if isinstance(holder, dict) and {"host", "pid"} <= holder.keys():
        return holder
    return {"host": "an unknown host", "pid": "?"}


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
