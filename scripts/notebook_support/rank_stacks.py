"""Where is every rank right now? py-spy dump of each worker of a torchrun on this node. Notebook support: a
learner may skip this module (notebook 09 shows what it finds).

py-spy (https://github.com/benfred/py-spy, in the course's requirements) reads the Python stack of a running
process from outside, without stopping it or changing its code:

    py-spy dump --pid PID

Which PID is which rank? torchrun starts the workers as its children and puts RANK in each one's
environment, so on a node ``ps --ppid <torchrun's pid>`` lists them and ``/proc/PID/environ`` names the
rank. ``dump_hung_job`` does it all for a job started here: it starts torchrun, waits until every rank
waits in a collective, dumps each one, and then lets the job end by its own timeout.

py-spy needs permission to read another process's memory (ptrace): the same user, and where the kernel's
Yama module is set to ptrace_scope 1, either an ancestor process, root, or a process that allowed it
(demos/hangs.py does, for the lab). The notebook says what to do on a cluster.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kit.output_paths import REPO

FRAME = re.compile(r"^\s+(?P<function>\S.*?) \((?P<file>[^()]+?)(?::(?P<line>\d+))?\)$")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # a terminal's colour codes
COLLECTIVES = "torch/distributed/distributed_c10d.py"  # all_reduce, barrier, broadcast, ...


@dataclass(frozen=True)
class Frame:
    function: str
    file: str  # as py-spy shortens it: relative to the folder on sys.path it was found in
    line: int | None

    def __str__(self):
        return f"{self.function} ({self.file}:{self.line})" if self.line else f"{self.function} ({self.file})"


def py_spy():
    """The py-spy next to this Python (a venv's bin/ is not always on PATH), else the one on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        raise FileNotFoundError("py-spy is not installed: pip install py-spy (it is in requirements.txt)")
    return found


def children(pid):
    """The processes ``pid`` started (Linux: /proc/PID/task/*/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return found


def rank_of(pid):
    """The RANK in a process's environment, or None (not a torchrun worker, or gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    values = [entry[5:].decode() for entry in environ if entry.startswith(b"RANK=")]
    return int(values[0]) if values and values[0].isdigit() else None


def workers(agent_pid):
    """{rank: pid} of the workers a torchrun agent started on this node."""
    ranks = {pid: rank_of(pid) for pid in children(agent_pid)}
    return {rank: pid for pid, rank in ranks.items() if rank is not None}


def dump(pid):
    """py-spy's dump of one process: its text, or py-spy's error. Without colours: py-spy colours its output
    where the environment asks for it (a Jupyter kernel's does), and the codes would stay in the text."""
    done = subprocess.run([py_spy(), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    text = done.stdout if done.returncode == 0 else f"py-spy failed ({done.returncode}): {done.stderr.strip()}"
    return COLOUR.sub("", text)


def main_thread(text):
    """The frames of the main thread in a py-spy dump, innermost first."""
    frames, inside = [], False
    for line in text.splitlines():
        if line.startswith("Thread "):
            inside = '"MainThread"' in line
        elif inside and (match := FRAME.match(line)):
            frames.append(Frame(match["function"], match["file"], int(match["line"]) if match["line"] else None))
    return frames


def waiting_collective(frames):
    """(the torch.distributed call a rank waits in, the first frame of the rank's own code under it), or None
    when the rank is not inside a collective."""
    for inner, frame in enumerate(frames):
        if frame.file.endswith(COLLECTIVES):
            callers = [caller for caller in frames[inner + 1:] if not caller.file.startswith("torch/")]
            return (frame, callers[0]) if callers else None
    return None


def waits_in_a_collective(frames):
    return waiting_collective(frames) is not None


def dump_every_rank(agent_pid, texts=None):
    """{rank: main-thread frames} of every worker of a torchrun agent, dumped one after the other; each
    dump's whole text also goes into ``texts`` (a dict), if one is given."""
    stacks = {}
    for rank, pid in sorted(workers(agent_pid).items()):
        text = dump(pid)
        stacks[rank] = main_thread(text)
        if texts is not None:
            texts[rank] = text
    return stacks


def dump_hung_job(script, *args, nproc=2, ready=waits_in_a_collective, deadline=120, env=None, keep_text=None):
    """Start ``scripts/<script>`` under torchrun, dump every rank once each one is ``ready`` (by default:
    waiting in a collective), then wait for the job to end by itself.

    Returns (stacks, output, status): {rank: frames} as last dumped, what the job printed (stdout and stderr
    together), its exit status; ``keep_text`` (a dict), if given, receives the last dumps' whole text. If the
    ranks are not all ready within ``deadline`` seconds, the last dumps are
    returned as they are. The job is never killed from here: it must end by itself (its --timeout).
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"scripts/{script}", *map(str, args)]
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a chatty job never blocks on a full pipe
        job = subprocess.Popen(command, cwd=REPO, env=env or dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
                               text=True)
        stacks, give_up = {}, time.monotonic() + deadline
        while job.poll() is None and time.monotonic() < give_up:
            stacks = dump_every_rank(job.pid, keep_text)
            if len(stacks) == nproc and all(ready(frames) for frames in stacks.values()):
                break
            time.sleep(0.5)
        try:
            job.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            job.kill()  # a safety net only: the job was to end by its own timeout, and did not
            job.wait()
            raise RuntimeError(f"{script} did not end by itself within {deadline} s of the dumps") from None
        log.seek(0)
        return stacks, log.read(), job.returncode
