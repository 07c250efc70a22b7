"""How a job's callbacks are wired: in one place (machinery/job.py), in a fixed order, with one checkpoint folder and
one writer handed to the callbacks that need them, and no callback changing another's methods."""
import datetime
import inspect

import pytest
import torch

from kit import checkpoints
from lesson import process
from machinery import cli, fault_drills, graceful_stop, job, reporting, resume, signals, stragglers

ORDER = [stragglers.StragglerWatch, reporting.RunRecord, reporting.ProgressBar, resume.Checkpointing,
         graceful_stop.GracefulStop]


def runtime_of(rank):
    return process.Runtime(rank, rank, 1, 1, torch.device("cpu"), None, 1, datetime.timedelta(seconds=60))


def built(*flags, rank=0):
    return job.callbacks("step4_ddp", cli.parse_args(list(flags)), runtime_of(rank))


def test_the_callbacks_come_in_the_order_job_py_gives():
    """The drill comes after checkpointing, so that a restart resumes from the checkpoint of the step it struck
    after; the graceful stop comes last, so that it saves only a step the checkpointing callback did not."""
    assert [type(callback) for callback in built()] == ORDER
    with_drill = [type(callback) for callback in built("--fault", "kill")]
    assert with_drill == [*ORDER[:4], fault_drills.StrikeAfterStep, ORDER[4]]


def test_one_checkpoint_folder_is_resolved_and_handed_to_both_callbacks_that_use_it(tmp_path):
    callbacks = built("--checkpoint-dir", str(tmp_path / "mine"))
    checkpointing, stop = callbacks[3], callbacks[-1]
    assert checkpointing.folder == stop.folder == tmp_path / "mine"
    assert built("--run-name", "named")[3].folder == job.checkpoint_folder("step4_ddp", run_name="named")


@pytest.mark.parametrize("rank, fault, crashes", [(0, None, False), (0, "crash-in-save", True),
                                                  (1, "crash-in-save", False), (0, "kill", False)])
def test_the_writer_is_the_drill_s_only_where_it_strikes(rank, fault, crashes):
    flags = ["--fault", fault] if fault else []
    write = built(*flags, rank=rank)[3].write
    assert (getattr(write, "func", None) is fault_drills.write_or_crash) == crashes
    assert crashes or write is checkpoints.write_atomically


@pytest.mark.parametrize("flags", [(), ("--fault", "crash-in-save"), ("--fault", "kill"), ("--stop-after", "60")])
def test_no_callback_replaces_a_method_of_another(flags):
    """Every method a callback has is its class's own: nothing assigned one over it (as a wrapper once was)."""
    for callback in built(*flags):
        methods = {name for name, _ in inspect.getmembers(type(callback), inspect.isfunction)}
        assert methods.isdisjoint(vars(callback)), f"{type(callback).__name__}: {methods & set(vars(callback))}"


def test_the_sigterm_limit_counts_the_newest_checkpoint_at_once():
    """signals.py asks the graceful stop for its limit when SIGTERM comes: a checkpoint written after the last step
    (an epoch's) counts at once, not from the next step on. 3 x 0.5 s steps + 2 x 15 s checkpoints + 1."""
    callbacks = built()
    checkpointing, stop = callbacks[3], callbacks[-1]
    assert signals.stuck_after() == 10  # nothing measured yet: never less than 10 s
    stop.longest_step, checkpointing.longest_save = 0.5, 15.0
    assert signals.stuck_after() == 32
