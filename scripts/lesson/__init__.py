"""The lesson: what a learner reads to follow one training step of the step scripts.

- ``process``: who a process is (rank, local rank, world size), its device and backend, the pre-flight check;
- ``data``: batches cut from in-memory tensors in a sampler's order, and the evaluation shard;
- ``models``: the Net, and ``build_model`` for every model ``--model`` names;
- ``loop``: the step, the epoch and exact evaluation, with the named points where a job's machinery plugs in.

The lesson stands on the kit (``scripts/kit/``: data sets, checkpoint files, precision, the learning rate's
scaling); what a real job adds around the loop (flags, checkpoints and resuming, fault drills, finding a stalled
rank, records and MFU) is in ``scripts/machinery/``. A learner may skip both.
"""
