"""The lesson: what a learner reads to follow one training step of the step scripts.

- ``process``: who a process is (rank, local rank, world size), its device and backend, the pre-flight check;
- ``data``: batches cut from in-memory tensors in a sampler's order, and the evaluation shard;
- ``models``: the Net, and ``build_model`` for every model ``--model`` names;
- ``loop``: the step, the epoch and exact evaluation, with the named points where a job's machinery plugs in.

Everything a real job needs besides (flags, checkpoints and resuming, fault drills, finding a stalled
rank, records and MFU, more data sets and models) is in ``scripts/machinery/``: a learner may skip it.
"""
