"""What a job adds around the training loop. Machinery: a learner may skip this module, and every module here.

The lesson (``scripts/lesson/``) holds the step, the epoch and evaluation, standing on the kit
(``scripts/kit/``); what a job on a cluster needs besides plugs into the loop as callbacks, built and wired in
one place (``job.py``). Modules here may import ``lesson`` and ``kit``; neither imports them.

- ``cli``: every flag, one parse, and how errors reach the user (``cli.run``);
- ``job``: the callbacks every training script hands its Trainer, and how they are wired;
- ``resume``: when to resume, when to save; ``fault_drills``: make a rank die, exit or stall, crash while
  saving, or signal torchrun, to watch what follows;
- ``folder_lock``: one run per checkpoint folder; ``divergence``: a loss no longer finite stops the run;
- ``signals``: what a signal does to this process; ``walltime``: durations and the job's clock;
  ``graceful_stop``: every rank stops after the same step, with a checkpoint of it;
- ``stragglers``: which rank fell behind when a collective fails;
- ``reporting``: the line per epoch, the JSON record, MFU and a progress bar;
- ``finetune``: pretrained weights and frozen layers for notebook 06.
"""
