"""The kit the lesson stands on: what the training loop is made of besides the lesson's own lines. Kit: a learner
may skip this module, and every module here.

Imports run one way: the step scripts -> ``machinery`` (what a job adds around the loop) -> ``lesson`` -> ``kit``.
No module here imports ``lesson`` or ``machinery`` (tests/test_layout.py checks it).

- ``errors``: one-line errors; ``agreement``: checks every rank passes or fails together;
- ``output_paths``: where results and checkpoints go, and how paths are printed;
- ``checkpoints``: the checkpoint file (atomic writes, exact reads, random states);
- ``datasets`` (with ``synthetic_cifar10``): the data sets, in memory or through a DataLoader;
- ``more_models`` (with ``sync_batchnorm``): the models beyond the Net, and SyncBatchNorm;
- ``precision``: autocast and fp16's gradient scaler; ``learning_rate``: the linear scaling rule and its warm-up;
- ``launch_checks``: torchrun's variables, gloo's interfaces, a store of its own for each restarted group;
- ``mfu``: model FLOPs and a device's peak, for MFU;
- ``exactness``: full FP32 and fixed cuDNN algorithms on a GPU, for the runs compared to 1e-6;
- ``schedulers``: PBS's and Slurm's client commands, and whether a job has ended (no torch).
"""
