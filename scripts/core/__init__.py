"""The shared core of the course's training scripts.

Every entry script in ``scripts/`` (train_single, train_allreduce, train_dp,
train_ddp) is a thin file that picks a sampler, wraps the model and, for the
hand-written step, averages gradients. Everything they have in common lives here:

- ``cli``: the command line every script shares, and clean one-line errors;
- ``distributed``: device, backend, thread count, process group set-up and teardown;
- ``data``: the data sets, the fast in-memory batches and the DataLoader route;
- ``models``: the networks the scripts can train;
- ``training``: the train step, the epoch loop and exact distributed evaluation;
- ``reporting``: per-epoch lines, throughput, MFU and the JSON record of a run.
"""


class CourseError(Exception):
    """A problem the user can fix: printed as one line, exit status 1."""
