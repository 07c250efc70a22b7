"""scripts/demos/hangs.py and the py-spy route of notebook 09: each hang ends by itself, at the process
group's timeout, with the message the notebook shows; py-spy finds where every rank of a hung job waits."""
import os
import re
import subprocess

import pytest

from demos import runner
from helpers import REPO, SCRIPTS, script_env, torchrun_command
from notebook_support import rank_stacks

pytestmark = pytest.mark.slow  # every test here waits out a hung job's timeout

HANGS = SCRIPTS / "demos" / "hangs.py"
RUN_SECONDS = 300  # far above any demo's --timeout: a run that reaches it did not end by itself


def line_of(text):
    """The line number of the line of demos/hangs.py that holds ``text``."""
    found = [number for number, line in enumerate(HANGS.read_text().splitlines(), 1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def run_hangs(*demo_args, nproc=2, **env):
    done = subprocess.run(torchrun_command("demos/hangs.py", *demo_args, nproc=nproc), cwd=REPO,
                          env=script_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_SECONDS)
    assert done.returncode != 0, done.stdout  # every demo hangs, and the timeout ends the job
    return done.stdout


def test_py_spy_finds_the_collective_each_rank_of_a_hung_job_waits_in():
    """Rank 0 waits in the all_reduce it alone calls, rank 1 in the barrier after it; then the timeout ends it."""
    def both_in_the_demo(frames):
        waiting = rank_stacks.waiting_collective(frames)
        return waiting is not None and waiting[1].file == "demos/hangs.py"

    stacks, output, status = rank_stacks.dump_hung_job("demos/hangs.py", "--demo", "skip-then-barrier",
                                                       "--timeout", 30, ready=both_in_the_demo, env=script_env())
    waits = {rank: rank_stacks.waiting_collective(frames) for rank, frames in stacks.items()}
    assert sorted(waits) == [0, 1], stacks
    (collective_0, caller_0), (collective_1, caller_1) = waits[0], waits[1]
    assert (collective_0.function, collective_0.file) == ("all_reduce", "torch/distributed/distributed_c10d.py")
    assert (caller_0.function, caller_0.line) == ("demo_skip_then_barrier", line_of("rank 0 waits here"))
    assert (collective_1.function, collective_1.file) == ("barrier", "torch/distributed/distributed_c10d.py")
    assert (caller_1.function, caller_1.line) == ("demo_skip_then_barrier", line_of("the others wait here"))
    assert status != 0 and "Timed out waiting 30000ms" in output, output  # it ended by itself, at its timeout


def test_without_the_debug_check_a_mismatch_returns_on_one_rank_and_times_out_on_the_other():
    output = run_hangs("--demo", "shapes", "--timeout", 3)
    shapes = runner.split_sections(output).get("shapes")
    assert shapes is not None, output  # the demo started: every rank joined and passed the pre-flight
    assert "rank 0: all_reduce returned [2.0, 2.0, 2.0]" in shapes, output  # 3 values summed, no error
    assert re.search(r"^error: rank 1: RuntimeError: Timed out waiting 3000ms for recv operation to complete$",
                     output, re.M), output


def test_a_rank_that_starts_late_is_waited_for_and_the_timeout_counts_from_a_common_start(tmp_path):
    """Rank 0 starts 8 s after rank 1, far beyond the demo's 3 s: init_process_group alone would give up on it
    after 3 s. The ranks meet on torchrun's store first (launch_checks.wait_for_every_rank), so the demo runs."""
    late_start = tmp_path / "late_start"
    late_start.mkdir()
    (late_start / "sitecustomize.py").write_text(  # Python imports it at start-up, before the script
        'import os, time\nif os.environ.get("RANK") == "0":\n    time.sleep(8)\n')
    output = run_hangs("--demo", "shapes", "--timeout", 3,
                       PYTHONPATH=os.pathsep.join(filter(None, [str(late_start), os.environ.get("PYTHONPATH")])))
    shapes = runner.split_sections(output).get("shapes")
    assert shapes is not None, output
    assert "rank 0: all_reduce returned [2.0, 2.0, 2.0]" in shapes, output
    assert "Timed out waiting 3000ms for recv operation" in output, output  # the demo's own timeout ended it


def test_the_debug_check_names_each_mismatch_and_the_rank_that_never_came():
    output = run_hangs("--demo", "shapes", "ops", "skip", "--timeout", 3, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    sections = runner.split_sections(output)
    assert {"shapes", "ops"} <= sections.keys(), output
    for rank, mine, theirs in [(0, "[3]", "[4]"), (1, "[4]", "[3]")]:
        assert re.search(rf"^rank {rank}: RuntimeError: Detected mismatch between collectives on ranks\. Rank {rank} "
                         rf"is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, OpType=ALLREDUCE, "
                         rf"TensorShape={re.escape(mine)}, .*, but Rank {1 - rank} is running collective: "
                         rf"CollectiveFingerPrint\(.*TensorShape={re.escape(theirs)}.*\)\)\.Collectives differ in the "
                         rf"following aspects: +Tensor Tensor shapes: {mine[1]}vs {theirs[1]}$",
                         sections["shapes"], re.M), sections["shapes"]
    assert re.search(r"^rank 0: .*OpType=ALLREDUCE.*but Rank 1 is running collective: .*OpType=BROADCAST.*"
                     r"Op type: ALLREDUCEvs BROADCAST$", sections["ops"], re.M), sections["ops"]
    assert re.search(r"^rank 1: .*OpType=BROADCAST.*Op type: BROADCASTvs ALLREDUCE$", sections["ops"], re.M)
    assert re.search(r"^error: rank 0: RuntimeError: \[Rank 0\]: Ranks 1 failed to pass monitoredBarrier in 3000 ms$",
                     output, re.M), output


def test_uneven_batches_end_with_the_straggler_line_naming_the_rank_behind():
    output = run_hangs("--demo", "uneven", "--short-rank", 1, "--timeout", 3)
    assert re.search(r"^error: rank 0 waited longer than --timeout 3 s in a collective at step 2: rank 1 "
                     r"last reported step 2 \d+ s ago \(ending the epoch\)\. ", output, re.M), output


def test_a_collective_only_rank_0_calls_times_out_on_rank_0():
    output = run_hangs("--demo", "skip", "--timeout", 3)
    assert re.search(r"^error: rank 0: RuntimeError: Timed out waiting 3000ms for recv operation to complete$",
                     output, re.M), output
    assert "error: rank 1" not in output  # rank 1 was busy elsewhere: torchrun stopped it, it had nothing to say
