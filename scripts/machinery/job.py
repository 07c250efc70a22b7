"""What a real job adds around the training loop, as one list of callbacks. Machinery: a learner may skip
this module.

    trainer = loop.Trainer(..., callbacks=job.callbacks("step4_ddp", args, runtime))

The Trainer calls them at each point of the loop (lesson/loop.py, ``Callback``) in this order:
1. the straggler watch: each rank's position, so that a failed collective names the rank behind (stragglers.py);
2. the run's record: rank 0's line per epoch, the JSON record, MFU (reporting.py);
3. a progress bar on a terminal (reporting.py);
4. checkpointing: the outputs checked, the one resume decision, a checkpoint every N steps and at every
   epoch's end (resume.py);
5. the fault drill --fault asks for, if any, after the step's checkpoint (fault_drills.py);
6. the graceful stop, last: on a signal, a stop request or the end of --stop-after, every rank stops after the
   same step, with a checkpoint of it (graceful_stop.py).
A new capability of every training script is one more callback here; none needs an edit inside the loop.
"""
from . import fault_drills, graceful_stop, reporting, resume, stragglers


def callbacks(script, args, runtime):
    record = reporting.RunRecord(script, args, runtime)
    checkpointing = resume.Checkpointing(script, args, runtime, record)
    return [stragglers.StragglerWatch(runtime), record, reporting.ProgressBar(runtime), checkpointing,
            *fault_drills.drills(args, runtime, checkpointing),
            graceful_stop.GracefulStop(args, runtime, checkpointing)]
