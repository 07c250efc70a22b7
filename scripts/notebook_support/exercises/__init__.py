"""The checks of the notebooks' exercises. Notebook support: a learner may skip this module.

Every exercise in the notebooks has three cells: one where the participant writes the
answer (it starts as a placeholder, ``...``), one that can load the solution from
``notebooks/solutions/`` (a commented ``%load`` line, so nothing shows before it is asked
for), and a check cell that calls one of the checks on the participant's names:

- a placeholder left as it is prints "not attempted yet", and the notebook runs on;
- a wrong answer raises AssertionError with a hint that does not give the answer away;
- a right answer prints "correct" and what the result teaches.

A check returns nothing: its printed line is the verdict, and the cell shows only that line.

The checks compare with the real thing wherever they can (DistributedSampler, PyTorch's
FLOP counter, a torchrun of the collectives demo, what DDP did), not with a stored answer.

Each notebook's checks are in a module named after it (``nb01_baseline.py`` for
``01_baseline.ipynb``); ``registry.py`` registers them. The notebooks call them from here,
as ``exercises.check_flops(...)``. ``EXERCISES`` lists them all, for the tests.
"""
# Importing a notebook's module registers its checks.
from .nb00_concepts import check_predict, check_where, collectives_record  # noqa: F401
from .nb01_baseline import check_misclassified, check_padding  # noqa: F401
from .nb02_allreduce_by_hand import check_seed_per_rank, check_shard, check_uneven_average  # noqa: F401
from .nb03_data_parallel import check_replicate_traffic, check_scatter, check_through_rank0  # noqa: F401
from .nb04_ddp import check_predict_buckets, check_rescued, check_save_and_load  # noqa: F401
from .nb05_checkpoints_and_faults import check_resume_epoch  # noqa: F401
from .nb06_real_models import check_finetune_wrap, check_replica_gpus, ddp_bytes_per_step  # noqa: F401
from .nb07_beyond_ddp import check_bf16_hook, check_zero_state_per_rank  # noqa: F401
from .nb08_performance import check_all_reduce_timing, check_communication_share  # noqa: F401
from .nb09_when_it_hangs import check_culprit, check_odd_rank, hung_job_evidence, rank_dumps, where_each_rank_waits  # noqa: F401
from .registry import EXERCISES, NOT_ATTEMPTED, Exercise, exercise, is_placeholder  # noqa: F401
