"""Small helpers the notebooks use, so that no notebook pastes code of its own.

- ``torchrun``: start a script in several processes from a notebook cell, the way a
  terminal would (``mp.spawn`` of functions defined in a notebook cannot be pickled);
- ``show_diff``: print the diff between two scripts, which is the lesson of a step;
- ``read_record``: load the JSON record a run wrote;
- ``save_figure``: save a figure under ``figs/`` of the repository.
"""
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

from .cli import REPO
from .distributed import FRESH_STORE_PER_ATTEMPT

SCRIPTS = REPO / "scripts"
FIGS = REPO / "figs"


def torchrun(script, *args, nproc=2, timeout=600, echo=True):
    """Run ``scripts/<script>`` under torch.distributed.run on this machine; return its output.

    ``sys.executable -m torch.distributed.run`` rather than ``torchrun``: the kernel's
    Python is the one with torch installed, whatever is on PATH. Raises when the run fails.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(SCRIPTS / script), *map(str, args)]
    return run_and_check(command, script, timeout, echo)


def python(script, *args, timeout=600, echo=True):
    """Run ``scripts/<script>`` as one plain Python process; return its output."""
    return run_and_check([sys.executable, str(SCRIPTS / script), *map(str, args)], script, timeout, echo)


def run_and_check(command, script, timeout, echo):
    env = {**os.environ, **FRESH_STORE_PER_ATTEMPT}  # torchrun restarts need a fresh store (core.distributed)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + strip_launcher_banner(done.stderr)
    if echo or done.returncode != 0:  # a failed run always shows why
        print(output.rstrip())
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited with status {done.returncode}")
    return output


def strip_launcher_banner(stderr):
    """Drop torchrun's OMP_NUM_THREADS banner: the scripts set threads themselves and say so."""
    return "\n".join(line for line in stderr.splitlines()
                     if "OMP_NUM_THREADS" not in line and not line.startswith("*****")) + ("\n" if stderr else "")


def show_diff(before, after):
    """Print a unified diff of two files in ``scripts/``: what one step adds to the last."""
    old = (SCRIPTS / before).read_text().splitlines(keepends=True)
    new = (SCRIPTS / after).read_text().splitlines(keepends=True)
    print("".join(difflib.unified_diff(old, new, fromfile=before, tofile=after, n=1)))


def read_record(results_dir, run_name):
    return json.loads((Path(results_dir) / f"{run_name}.json").read_text())


def save_figure(fig, name):
    """Save a matplotlib figure as ``figs/<name>`` and say where, relative to the repository.

    No "Software" stamp in the PNG, so a rerun with the same numbers writes the same file.
    """
    FIGS.mkdir(exist_ok=True)
    fig.savefig(FIGS / name, dpi=110, bbox_inches="tight", metadata={"Software": None})
    print(f"saved figs/{name}")
