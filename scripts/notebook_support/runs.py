"""Running the course's scripts from a notebook cell, and what the notebooks show of them. Notebook support:
a learner may skip this module.

So that no notebook pastes code of its own:

- ``torchrun``: start a script in several processes from a notebook cell, the way a
  terminal would (``mp.spawn`` of functions defined in a notebook fails: notebook 00 shows why);
- ``python``: start a script as one plain process;
- ``show_diff``: print the diff between two scripts, which is the lesson of a step;
- ``read_record``: load the JSON record a run wrote;
- ``save_figure``: save a figure under ``results/figs/`` (in ``OUTPUT``), which git ignores;
- ``child_stderr``: collect what child processes write to stderr, instead of showing it;
- ``script_lines``: the lines a course script printed, without torchrun's own log lines.

A run that fails raises ``RunFailed``, whose message ends with the last lines of the
run's output, stderr included: a failed cell says why, also in a test report.
"""
import contextlib
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kit.launch_checks import FRESH_STORE_PER_ATTEMPT, reserved_port  # noqa: F401 (the notebooks' ports come from here)
from kit.output_paths import REPO, display_path, output_dir

SCRIPTS = REPO / "scripts"
# Where the notebooks' runs write: results/ and checkpoints/ under the course directory, or under
# $COURSE_OUTPUT_DIR where that is set (the test suite sets it, so that the notebooks write into a temporary
# folder). A notebook names its folders from here: OUTPUT / "results" / "notebooks".
OUTPUT = output_dir()
# Figures drawn by the notebooks hold this machine's measurements, so they go where git
# does not look. The reference copies in figs/ change only through `make figures`.
FIGURES = OUTPUT / "results" / "figs"
TAIL_LINES = 40  # how much of a failed run's output its exception carries


class RunFailed(RuntimeError):
    """A script started from a notebook exited with an error (or ran past its time limit)."""

    def __init__(self, script, status, output):
        self.script, self.status, self.output = script, status, output
        tail = "\n".join(output.rstrip().splitlines()[-TAIL_LINES:]) or "(no output)"
        super().__init__(f"{script} {status}; the last lines of its output (stderr included):\n{tail}")


def torchrun(script, *args, nproc=2, timeout=600, echo=True, launcher_args=("--standalone",), env=None):
    """Run ``scripts/<script>`` under torch.distributed.run on this machine; return its output.

    ``sys.executable -m torch.distributed.run`` rather than ``torchrun``: the kernel's
    Python is the one with torch installed, whatever is on PATH. ``launcher_args`` are
    torchrun's own flags (``--standalone``: one node, a free port). Raises RunFailed.
    """
    command = [sys.executable, "-m", "torch.distributed.run", *map(str, launcher_args),
               f"--nproc-per-node={nproc}", f"scripts/{script}", *map(str, args)]
    if restarts_allowed(launcher_args):
        env = {**(os.environ if env is None else env), **FRESH_STORE_PER_ATTEMPT}
    return run_and_check(command, script, timeout, echo, env)


def restarts_allowed(launcher_args):
    """``--max-restarts=K`` (or ``--max-restarts K``) with K > 0 among torchrun's flags."""
    words = " ".join(map(str, launcher_args)).replace("=", " ").split()
    return any(word == "--max-restarts" and int(after) > 0 for word, after in zip(words, words[1:]))


def python(script, *args, timeout=600, echo=True, env=None):
    """Run ``scripts/<script>`` as one plain Python process; return its output."""
    return run_and_check([sys.executable, f"scripts/{script}", *map(str, args)], script, timeout, echo, env)


def run_and_check(command, script, timeout, echo, env=None):
    """Run ``command`` in the repository, stdout and stderr in one stream, in the order written.

    ``env``: the whole environment of the run (default: the kernel's).
    """
    try:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        partial = expired.output.decode(errors="replace") if isinstance(expired.output, bytes) else expired.output
        raise RunFailed(script, f"ran past its {timeout} s limit and was stopped", partial or "") from None
    output = strip_launcher_banner(done.stdout)
    if echo:
        print(output.rstrip())
    if done.returncode != 0:
        raise RunFailed(script, f"exited with status {done.returncode}", output)
    return output


@contextlib.contextmanager
def child_stderr():
    """Collect, as a list of lines, what child processes started in the block write to stderr.

    A notebook's kernel shows its children's stderr in the cell, paths and process ids
    included; this catches it at the file descriptor that the children inherit.
    """
    sys.stderr.flush()
    lines = []
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def strip_launcher_banner(output):
    """Drop torchrun's OMP_NUM_THREADS banner: the scripts set threads themselves and say so."""
    kept = [line for line in output.splitlines() if "OMP_NUM_THREADS" not in line and not line.startswith("*****")]
    return "\n".join(kept).lstrip("\n") + ("\n" if kept else "")  # the banner starts with an empty line


# torchrun's own log lines: "W1123 10:54:46.587000 3298 .../api.py:1028] Sending process ..." (glog style:
# level, date, time, pid, source); they carry times, process ids and paths of this machine.
LAUNCHER_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
# PyTorch's C++ warnings from a worker, "[rank1]:[W1123 11:00:27.892 TCPStore.cpp:125] ...", and the C++
# stack that may follow one ("Exception raised from ...", "frame #0: ...").
WORKER_LOG_LINE = re.compile(r"^\[rank\d+\]:\[[IWEF]\d{4} ")
CPP_STACK_LINE = re.compile(r"^(Exception raised from |frame #\d+: |<omitting python frames>|$)")


def script_lines(output):
    """What the course script printed, from a torchrun's output: torchrun's log lines, PyTorch's
    C++ warnings and the traceback a failed job ends with are left out."""
    kept, in_cpp_warning = [], False
    for line in output.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            break  # torchrun's ChildFailedError and its summary follow; the script's own error line came before
        if WORKER_LOG_LINE.match(line):
            in_cpp_warning = True
            continue
        if in_cpp_warning and CPP_STACK_LINE.match(line):
            continue
        in_cpp_warning = False
        if not LAUNCHER_LOG_LINE.match(line):
            kept.append(line)
    return kept


def launcher_lines(output):
    """torchrun's own log lines, each without its time, process id and source prefix."""
    return [LAUNCHER_LOG_LINE.sub("", line) for line in output.splitlines() if LAUNCHER_LOG_LINE.match(line)]


def show_diff(before, after):
    """Print a unified diff of two files in ``scripts/``: what one step adds to the last."""
    old = (SCRIPTS / before).read_text().splitlines(keepends=True)
    new = (SCRIPTS / after).read_text().splitlines(keepends=True)
    print("".join(difflib.unified_diff(old, new, fromfile=before, tofile=after, n=1)))


def read_record(results_dir, run_name):
    return json.loads((Path(results_dir) / f"{run_name}.json").read_text())


def save_figure(fig, name):
    """Save a matplotlib figure as ``results/figs/<name>`` (in OUTPUT) and say where, relative to OUTPUT.

    No "Software" stamp in the PNG, so a rerun with the same numbers writes the same file.
    """
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURES / name, dpi=110, bbox_inches="tight", metadata={"Software": None})
    print(f"saved {display_path(FIGURES / name)}")
