"""Notebook 00, section 5.2: the plan ``scripts/tools/launch.py --dry-run`` prints for a made-up job. Notebook
support: a learner may skip this module.

The notebook runs on no cluster, so it hands launch.py the variables a batch system would set (PBS_NODEFILE,
NGPUS, SLURM_JOB_NODELIST, ...) and reads back the torchrun command that node would run.
"""
import os
import re
import shlex

from notebook_support.runs import python


def dry_run(**job):
    """launch.py --dry-run of the doctor's job, with the job's variables ``job`` instead of this machine's.

    Returns the printed plan (with ``python`` for this interpreter's path) and its torchrun command as words.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PBS_", "SLURM_", "NGPUS", "NCPUS"))}
    output = python("tools/launch.py", "--max-restarts", 0, "--dry-run", "scripts/tools/doctor.py",
                    env=env | job, echo=False)
    plan = re.sub(r"^\S+(?= -m torch\.distributed\.run)", "python", output.strip(), flags=re.M)
    return plan, shlex.split(plan[plan.index("python -m"):].replace("\\\n", " "))
