"""What a real job adds around the training loop, built and wired in this one place. Machinery: a learner may
skip this module.

    trainer = loop.Trainer(..., callbacks=job.callbacks("step4_ddp", args, runtime))

``callbacks`` resolves the checkpoint folder once, picks the checkpoint writer (the plain atomic one, or the
crashing one of ``--fault crash-in-save``), and hands both to the callbacks that need them: no callback reaches
into another to change it. The Trainer calls them at each point of the loop (lesson/loop.py, ``Callback``) in
this order, which tests/test_job.py pins:
1. the straggler watch: each rank's position, so that a failed collective names the rank behind (stragglers.py);
2. the run's record: rank 0's line per epoch, the JSON record, MFU (reporting.py);
3. a progress bar on a terminal (reporting.py);
4. checkpointing: the outputs checked, the checkpoint folder taken (one run per folder, folder_lock.py), the one
   resume decision, a checkpoint every N steps and at every epoch's end (resume.py);
5. the fault drill --fault asks for, if any: after the step's checkpoint, so that a restart resumes from it
   (fault_drills.py);
6. the graceful stop, last: on a signal, a stop request, the end of --stop-after or a loss that is no longer
   finite, every rank stops after the same step, with a checkpoint of it (none of a diverged step), unless the
   checkpointing callback just wrote one (graceful_stop.py).
A new capability of every training script is one more callback here; none needs an edit inside the loop.
"""
from pathlib import Path

from kit.output_paths import output_dir

from . import fault_drills, graceful_stop, reporting, resume, stragglers


def callbacks(script, args, runtime):
    folder = checkpoint_folder(script, args.checkpoint_dir, args.run_name)
    write = fault_drills.checkpoint_writer(args, runtime)
    record = reporting.RunRecord(script, args, runtime)
    checkpointing = resume.Checkpointing(script, args, runtime, record, folder, write)
    return [stragglers.StragglerWatch(runtime), record, reporting.ProgressBar(runtime), checkpointing,
            *fault_drills.drills(args, runtime),
            graceful_stop.GracefulStop(args, runtime, checkpointing, folder)]


def checkpoint_folder(script, checkpoint_dir=None, run_name=None):
    """Where a run's checkpoints go: --checkpoint-dir, else checkpoints/<--run-name, else the script's name>/ in
    the output folder ($COURSE_OUTPUT_DIR, else the course directory)."""
    return Path(checkpoint_dir) if checkpoint_dir else output_dir() / "checkpoints" / (run_name or script)
