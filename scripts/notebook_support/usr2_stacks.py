"""``kill -USR2`` on one rank of a hung job: the stacks that rank prints to its stderr. Notebook support: a learner
may skip this module (notebook 09 shows what it finds).

The course's scripts register Python's faulthandler on SIGUSR2 (machinery/signals.py, dump_stacks_on_sigusr2):

    kill -USR2 PID

makes the process print every thread's Python stack to its stderr, most recent call first, and go on. It is the
route where py-spy is refused, since it needs no ptrace. ``signal_hung_rank`` does it for a job started here: it
starts torchrun, waits until the rank has printed a line (its handlers are installed before its main starts),
sends SIGUSR2 to that rank's process alone until the dump shows it inside a collective, and then lets the job end
by its own timeout. The files of the frames are shortened as py-spy shortens them (``rank_stacks``), so that
the dump reads the same on any machine.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from kit.output_paths import REPO

from .rank_stacks import COLLECTIVES, workers

# faulthandler's lines: a thread's header, then one line per frame, most recent call first.
THREAD = re.compile(r"^(?P<which>Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)$')


@dataclass(frozen=True)
class Frame:
    function: str
    file: str  # relative to scripts/ or to the folder torch is installed in; else the file's name
    line: int

    def __str__(self):
        return f'File "{self.file}", line {self.line} in {self.function}'


def short_file(path):
    """A frame's file without this machine's folders: scripts/... of the course, torch/... of the install."""
    scripts = f"{REPO / 'scripts'}{os.sep}"
    if path.startswith(scripts):
        return path[len(scripts):]
    if "/torch/" in path:  # site-packages, dist-packages or a source build alike
        return "torch/" + path.rsplit("/torch/", 1)[1]
    return os.path.basename(path)


def thread_stacks(text):
    """Every thread stack of the faulthandler dumps in ``text``, in the order printed: a list of frame lists."""
    stacks = []
    for line in text.splitlines():
        if THREAD.match(line):
            stacks.append([])
        elif stacks and (match := FRAME.match(line)):
            stacks[-1].append(Frame(match["function"], short_file(match["file"]), int(match["line"])))
    return stacks


def main_stacks(text, script):
    """The main thread's stacks of every dump in ``text``: those whose outermost frame is ``script``'s module."""
    return [frames for frames in thread_stacks(text) if frames and frames[-1] == Frame("<module>", script,
                                                                                      frames[-1].line)]


def in_a_collective(frames):
    return bool(frames) and frames[0].file == COLLECTIVES


def signal_hung_rank(script, *args, rank, ready_line, nproc=2, deadline=120, env=None):
    """Start ``scripts/<script>`` under torchrun; once rank ``rank`` has printed ``ready_line``, send SIGUSR2 to
    that rank's process (and to no other) until its main thread's dump shows it inside a collective; then wait for
    the job to end by itself.

    Returns (frames, output, status): the main thread's frames of the last dump, most recent call first, what the
    job printed (stdout and stderr together, dumps included), its exit status. The job is never killed from here,
    except as a safety net when it does not end within ``deadline`` seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"scripts/{script}", *map(str, args)]
    module = script.removeprefix("./")
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a chatty job never blocks on a full pipe
        job = subprocess.Popen(command, cwd=REPO, env=env or dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
        frames, give_up, rank_process = [], time.monotonic() + deadline, None

        def running():
            return job.poll() is None and time.monotonic() < give_up

        def printed():  # pread: the job writes at the file's offset, which it shares with this process
            return os.pread(log.fileno(), os.fstat(log.fileno()).st_size, 0).decode(errors="replace")

        try:
            while running() and ready_line not in printed():
                time.sleep(0.2)
            pid = workers(job.pid).get(rank)
            # A pidfd names this very process: a signal through it never reaches another process that might reuse
            # the number after the rank has ended (it raises ProcessLookupError instead).
            rank_process = os.pidfd_open(pid) if pid else None
            while rank_process is not None and running() and not in_a_collective(frames):
                dumps = len(main_stacks(printed(), module))
                try:
                    signal.pidfd_send_signal(rank_process, signal.SIGUSR2)  # this rank only, a child of our torchrun
                except ProcessLookupError:
                    break  # the rank has ended: the job ends by itself
                while running() and len(stacks := main_stacks(printed(), module)) == dumps:
                    time.sleep(0.1)  # a dump is whole once the main thread's <module> frame is printed
                stacks = main_stacks(printed(), module)
                frames = stacks[-1] if len(stacks) > dumps else []
                if not in_a_collective(frames):
                    time.sleep(0.5)  # the rank was still on its way to the collective: ask again
            job.wait(timeout=max(1, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{script} did not end by itself within {deadline} s") from None
        finally:
            if rank_process is not None:
                os.close(rank_process)
            if job.poll() is None:
                job.kill()  # a safety net only: the job was to end by its own timeout
                job.wait()
        return frames, printed(), job.returncode
