"""What real jobs need around the training loop. Machinery: a learner may skip this module, and every
module here.

The lesson (``scripts/lesson/``) holds the step, the epoch and evaluation; what a job on a
cluster needs besides plugs into the loop as callbacks, listed in one place (``job.py``):

- ``cli``: every flag, and how errors reach the user; ``errors``: one-line errors;
- ``job``: the callbacks every training script hands its Trainer, in order;
- ``checkpoints``: the checkpoint file (atomic writes, exact reads); ``resume``: when to resume, when to save;
- ``fault_drills``: make a rank die, exit or stall, crash while saving, or signal torchrun, to watch what follows;
- ``graceful_stop``: on a signal, a STOP file or the end of --stop-after, every rank stops after the same step
  with a checkpoint of it;
- ``stragglers``: which rank fell behind when a collective fails;
- ``reporting``: the line per epoch, the JSON record, MFU (``mfu``) and a progress bar;
- ``agreement``: checks every rank passes or fails together;
- ``launch_checks``: torchrun's variables, gloo's interfaces, torchrun's restarts (a store of its own for each);
- ``datasets`` (with ``synthetic_cifar10``), ``more_models``, ``sync_batchnorm``, ``precision``, ``finetune``: the
  data sets, models and options of the later notebooks (06 and 07).
"""
