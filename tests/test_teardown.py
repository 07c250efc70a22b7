"""Scripts free their process group before Python shuts down.

`destroy_process_group()` joins gloo's worker threads when it frees the group. If something keeps the group
alive (torch.distributed.nn imported after `init_process_group` does, and so does a frame of a script's main left
in a reference cycle: scripts/kit/launch_checks.py and cli.run say why, and how the scripts avoid both), the
threads run on into the interpreter's shutdown, and one of them can free a tensor then and abort the process
("terminate called without an active exception", SIGABRT): a rare, load-dependent failure. These tests look for
its precondition, which is deterministic: gloo threads still alive when the script's ranks exit. A hook run at
exit (``atexit``, from a ``sitecustomize`` on PYTHONPATH, tests/gloo_exit_hook.py) counts them.

The scripts that tests of their own run already (scripts/demos/collectives.py, scripts/demos/ddp_mechanics.py,
the steps as `make run` starts them, scripts/demos/beyond_ddp.py and benchmarks/allreduce_bandwidth.py) are
checked on those runs, with this hook: tests/test_collectives_demo.py, tests/test_ddp_demos.py,
tests/test_scripts.py, tests/test_beyond.py and tests/test_benchmarks.py.
One run then shows both what the script prints and that it frees its group.
"""
import subprocess
import sys

import pytest

from gloo_exit_hook import COUNTS_THREADS_IN_PROC, exit_env, gloo_threads_at_exit
from helpers import SHORT_TEST_SPLIT, aborted_at_exit, assert_ok, output_folders, run_torchrun

pytestmark = [pytest.mark.slow, COUNTS_THREADS_IN_PROC]


def test_the_hook_sees_a_group_left_alive(tmp_path):
    """The check can fail: a script that never destroys its group exits with gloo's threads running.

    Such a script may then be aborted at exit (the hazard above), or may not: either way the hook ran
    first (atexit comes before the interpreter frees anything) and counted the threads of both ranks."""
    env, report = exit_env(tmp_path)
    script = tmp_path / "leaves_its_group.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "dist.all_reduce(torch.ones(4))\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if not aborted_at_exit(done):
        assert_ok(done)
    counted = gloo_threads_at_exit(report)
    assert [rank for rank, _ in counted] == [0, 1], counted
    assert all(threads > 0 for _, threads in counted), counted


def test_a_step_script_frees_its_group_with_pythons_own_collector_off(tmp_path):
    """A frame of main can outlive main in a reference cycle, and hold the model and its group: torch.fx.wrap keeps
    its callers' frames when torchvision and torch._dynamo are first imported inside main. cli.run collects the
    cycles itself once main is done, so the group goes whether Python's collector has run by then or not: here it
    never runs by itself."""
    env, report = exit_env(tmp_path, automatic_gc=False)
    assert_ok(run_torchrun("step4_ddp.py", "--epochs", 1, "--max-steps", 2, *SHORT_TEST_SPLIT,
                           *output_folders(tmp_path), env=env))
    assert gloo_threads_at_exit(report) == [(0, 0), (1, 0)]
