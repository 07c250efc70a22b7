"""What the tests share: the repository's paths, running scripts as a user would, and the checks of a
run's outcome (one line each, one meaning each)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from kit.launch_checks import FRESH_STORE_PER_ATTEMPT, reserved_port  # noqa: F401 (the tests take it from here)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PYTHON = sys.executable
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))  # the course's, in order
# Code in markdown: a fenced block or an inline span.
MARKDOWN_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def load_notebook(path):
    return json.loads(path.read_text())


def outputs_text(cell):
    """What a notebook cell printed: its streams, its text displays and its tracebacks."""
    text = []
    for output in cell.get("outputs", []):
        text.append("".join(output.get("text", "")))
        for kind, value in output.get("data", {}).items():
            if kind.startswith("text/"):
                text.append("".join(value))
        text.append("\n".join(output.get("traceback", [])))
    return "\n".join(text)


# The bundled MNIST subset with its test split cut to its first 100 images, for the runs whose claims are about
# training (weights, steps, stops, restarts), not about scoring: evaluating 1,000 test images at each epoch's end
# costs those short runs more than their steps. tests/conftest.py writes it, once in each test process (an xdist
# worker each), under the session's output folder (conftest.py at the top sets COURSE_OUTPUT_DIR).
SHORT_TEST_IMAGES = 100
SHORT_TEST_SPLIT_DIR = Path(os.environ["COURSE_OUTPUT_DIR"]) / (
    f"mnist5k-short-test-split-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}")
SHORT_TEST_SPLIT = ("--data-dir", SHORT_TEST_SPLIT_DIR)


# The runs that test_checkpoints.py and test_graceful_stop.py kill, stop and resume: 2 epochs of 6 steps, 32 images
# per rank and step, a checkpoint every 4 steps and at each epoch's end, so checkpoints land at steps 4, 6 (end of
# epoch 1), 8 and 12. The claims are about the weights: each epoch ends scoring the short test split.
RESUMABLE_RUN = ("--epochs", 2, "--max-steps", 6, "--batch-size", 32, "--checkpoint-every", 4, *SHORT_TEST_SPLIT)

# The runs of scripts/demos/beyond_ddp.py that test_beyond.py and test_exercises.py read (tests/conftest.py,
# beyond_demo_run): every demo it runs by default, in two groups, each rank's exit counted (tests/gloo_exit_hook.py);
# the FSDP2 demo alone, as its process group outlives the run (test_beyond.py, test_the_demos_free_their_groups).
BEYOND_DEMO_GROUPS = {"all-but-fsdp": ("overlap", "accumulate", "syncbn", "join", "zero"), "fsdp": ("fsdp",)}
MICRO_BATCHES = 4  # K, the micro-batches per optimizer step in the accumulate demo


def script_env(restarts=False, **extra):
    """The environment a launched script sees: no GPU, quiet torchrun banner, loopback only.

    ``restarts``: torchrun may restart the group (--max-restarts), so each attempt gets a fresh store, as the
    course's launchers give it (kit.launch_checks). Otherwise the workers share the agent's store, whose
    port the OS picked when it was bound: nothing for another process to take in between.
    """
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if restarts:
        env.update(FRESH_STORE_PER_ATTEMPT)
    env.update({name: str(value) for name, value in extra.items()})
    return env


def restarts_in(launcher):
    """True when torchrun options ``launcher`` let it restart a failed group."""
    return any(option.startswith("--max-restarts") and not option.endswith("=0") for option in map(str, launcher))


def run_python(script, *args, timeout=300, env=None):
    return subprocess.run([PYTHON, str(SCRIPTS / script), *map(str, args)], cwd=REPO, env=env or script_env(),
                          capture_output=True, text=True, timeout=timeout)


def torchrun_command(script, *args, nproc=2, launcher=()):
    """torchrun on this machine alone (--standalone): its rendezvous store binds a port the OS picks at that
    moment and a run id of its own, so two runs at once never meet, and no port is chosen first and taken later."""
    return [PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone", *launcher,
            str(SCRIPTS / script), *map(str, args)]


def run_torchrun(script, *args, nproc=2, timeout=300, launcher=(), env=None):
    return subprocess.run(torchrun_command(script, *args, nproc=nproc, launcher=launcher), cwd=REPO,
                          env=env or script_env(restarts=restarts_in(launcher)), capture_output=True, text=True,
                          timeout=timeout)


def assert_ok(done):
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"


def aborted_at_exit(done):
    """torchrun's report of a worker killed by SIGABRT: the abort at exit that a gloo group left alive invites
    (tests/test_teardown.py says when, and where each script's teardown is checked)."""
    return done.returncode != 0 and ("Signal 6 (SIGABRT)" in done.stderr or "exitcode  : -6" in done.stderr)


def error_lines(done):
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def assert_one_line_error(done, *fragments):
    """A course script's own error line (``error: ...``, from cli.run), and no traceback from the script.

    Under torchrun the launcher adds one traceback of its own (ChildFailedError) after the
    children exit; that one is torchrun's, and it comes after the script's line.
    """
    assert done.returncode != 0
    if "Traceback" in done.stderr:
        assert done.stderr.count("Traceback") == 1 and "ChildFailedError" in done.stderr, done.stderr
        assert error_lines(done) and done.stderr.index("error:") < done.stderr.index("Traceback")
    lines = error_lines(done)
    assert lines, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def read_json(path):
    return json.loads(Path(path).read_text())


def output_folders(folder):
    """The two folders a run writes into, both under ``folder``."""
    return ("--checkpoint-dir", folder / "checkpoints", "--results-dir", folder / "results")


def run_outputs(folder, name):
    """The output flags of run ``name`` whose files all go under ``folder``: its checkpoints, its record
    (results/<name>.json) and its final weights (<name>.pt, read back by ``saved_weights``)."""
    return ("--checkpoint-dir", folder / f"{name}-checkpoints", "--results-dir", folder / "results",
            "--run-name", name, "--save", folder / f"{name}.pt")


def saved_weights(folder, name):
    return torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)


def assert_same_weights(a, b):
    """Two state_dicts hold the same names and bit-for-bit the same tensors."""
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, (f"differ: {different[:5]} ({len(different)} of {len(a)}); largest gap "
                           f"{max((a[k] - b[k]).abs().max().item() for k in different):.1e}")
