"""The test session as a whole (tests/ and the notebooks under nbval alike): where its runs write, and the check
that it left the checkout as it found it. The tests' fixtures are in tests/conftest.py.

Every script a test starts and every notebook kernel nbval starts inherits this process's environment, so
setting COURSE_OUTPUT_DIR here sends their default results/ and checkpoints/ (and the notebooks' figures)
into a temporary folder of this session, never into the checkout; setting TMPDIR sends their temporary files
into another, never into the machine's /tmp.
"""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent
OUTPUT_DIR_VARIABLE = "COURSE_OUTPUT_DIR"  # scripts/kit/output_paths.py reads it
# What a test session may leave in the checkout: the environment, pytest's own cache, and the bytecode caches
# Python writes next to the modules it imports (`make test` turns those off: PYTHONDONTWRITEBYTECODE=1).
MAY_STAY = {".git", ".venv", ".pytest_cache", "__pycache__"}


def checkout_files():
    """Every file and folder in the checkout, with its size and modification time, except MAY_STAY."""
    found = {}
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if name not in MAY_STAY]
        for name in [*subfolders, *files]:
            if name in MAY_STAY:
                continue
            path = Path(folder, name)
            stat = path.lstat()
            found[str(path.relative_to(REPO))] = (stat.st_size, stat.st_mtime_ns) if name in files else "folder"
    return found


def is_worker(config):
    """A pytest-xdist worker: the controller process checks the checkout, once."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin has set up its factory
def pytest_configure(config):
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # nor in the scripts and kernels the tests start
    # A process with more than one CPU thread (a one-process run, a notebook kernel, this one) has OpenMP threads
    # that spin when they run out of work, 300,000 turns before they sleep (the libgomp manual, GOMP_SPINCOUNT;
    # torch's wheels use libgomp). Alone on its cores that costs little; with three test files at once on 2 cores
    # it burns the CPU another test needs (a 60-step run of step1_baseline.py with 2 threads took about twice the
    # CPU time of the same run with 1, beside a busy test session). PASSIVE threads sleep at once; the thread
    # counts, and so the results, stay the same.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # glibc's malloc gives a block above its mmap threshold a mapping of its own and unmaps it when it is freed;
    # the threshold starts at 128 KiB and rises with the blocks freed, to 32 MiB at most (mallopt(3),
    # M_MMAP_THRESHOLD). A step's activations and an evaluation's (the Net's second convolution makes 70 MiB of
    # a 500-image batch) are freed and allocated again at every step, so each step pays the kernel to map and
    # zero them anew. With both thresholds at 256 MiB (setting either ends the dynamic adjustment) they stay in the heap
    # and are reused. Measured here: a 20-step run of step4_ddp.py, 1.27-1.34 s of system time before,
    # 0.66-0.74 s after; `make test-fast`, 33.5 s before, 23.6 s after; the user time and the results the same.
    os.environ.setdefault("GLIBC_TUNABLES",
                          "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=268435456")
    if OUTPUT_DIR_VARIABLE not in os.environ or not is_worker(config):
        os.environ[OUTPUT_DIR_VARIABLE] = str(config._tmp_path_factory.mktemp("course-output", numbered=False))
        # Their temporary files go to a folder of this session as well, not to the machine's /tmp: torchrun leaves
        # a torchelastic_* log folder there at every launch (torch.distributed.elastic's DefaultLogsSpecs,
        # tempfile.mkdtemp), and Jupyter and the browser leave folders of their own.
        os.environ["TMPDIR"] = str(config._tmp_path_factory.mktemp("tmp", numbered=False))
    if not is_worker(config):
        config.stash[CHECKOUT_BEFORE] = checkout_files()
    if config.getoption("nbval", False) or config.getoption("nbval_lax", False):
        use_this_environment_for_the_notebooks(config.option)


def use_this_environment_for_the_notebooks(option):
    """A plain `pytest --nbval notebooks/` runs as `make test` does: in the Python running pytest (the notebooks
    ask for the kernel "ddp-course", which exists only after `make kernel`, and nbval would stop with NoSuchKernel)
    and with the course's sanitizer. What the command line names wins: a kernel (--nbval-kernel-name), a sanitizer."""
    if not option.nbval_kernel_name:
        option.nbval_current_env = True
    if option.nbval_sanitize_with is None:
        option.nbval_sanitize_with = str(REPO / "notebooks" / "sanitize.cfg")


# The files that take longest, measured on 2 cores (--durations), run first: pytest-xdist hands each worker a
# whole file at a time, and a long file handed out last would leave the other workers idle to the end. The
# order decides when a test runs, never what it sees; the Makefile's --no-loadscope-reorder keeps it (xdist
# would otherwise order the files by their number of tests). The other files follow in collection order.
LONGEST_FIRST = ["tests/test_pbs.py", "tests/test_slurm.py", "tests/test_graceful_stop.py", "tests/test_beyond.py",
                 "tests/test_hangs.py", "tests/test_scripts.py", "tests/test_real_models.py",
                 "tests/test_benchmarks.py",
                 "tests/test_checkpoints.py", "tests/test_errors.py", "notebooks/09_when_it_hangs.ipynb",
                 "notebooks/00_concepts.ipynb", "notebooks/04_ddp.ipynb", "notebooks/05_checkpoints_and_faults.ipynb"]


def pytest_collection_modifyitems(session, config, items):
    rank = {path: position for position, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: a file stays whole


CHECKOUT_BEFORE = pytest.StashKey[dict]()
LEFT_BEHIND = pytest.StashKey[list]()


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if is_worker(config) or CHECKOUT_BEFORE not in config.stash:
        return
    before, after = config.stash[CHECKOUT_BEFORE], checkout_files()
    changed = sorted(path for path in after.keys() | before.keys() if before.get(path) != after.get(path))
    config.stash[LEFT_BEHIND] = changed
    if changed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    changed = config.stash.get(LEFT_BEHIND, [])
    if changed:
        terminalreporter.section("the checkout changed", red=True)
        terminalreporter.line(f"The test session wrote into the checkout ({REPO}); tests write only under pytest's "
                              f"temporary folders, scripts by default under ${OUTPUT_DIR_VARIABLE}. New, changed "
                              f"or removed:", red=True)
        for path in changed[:50]:
            terminalreporter.line(f"  {path}", red=True)
        if len(changed) > 50:
            terminalreporter.line(f"  ... and {len(changed) - 50} more", red=True)
