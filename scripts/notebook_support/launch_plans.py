"""Notebook 00, section 5.2: the plan ``scripts/tools/launch.py --dry-run`` prints for a made-up job. Notebook
support: a learner may skip this module.

The notebook runs on no cluster, so it hands launch.py the variables a batch system would set (PBS_NODEFILE,
CUDA_VISIBLE_DEVICES, SLURM_JOB_NODELIST, ...) and reads back the torchrun command that node would run.
"""
import os
import re
import shlex

from notebook_support.runs import python

# What launch.py reads of a job's GPUs and CPUs, besides the PBS_* and SLURM_* variables (granted_gpus, cpus_here).
JOB_GPU_AND_CPU_VARIABLES = {"CUDA_VISIBLE_DEVICES", "NGPUS", "NCPUS"}


def dry_run(**job):
    """launch.py --dry-run of the doctor's job, with the job's variables ``job`` instead of this machine's.

    Returns the printed plan (with ``python`` for this interpreter's path) and its torchrun command as words.
    The kernel's own job and GPU variables are dropped first, those launch.py reads included (SLURM_GPUS_ON_NODE,
    CUDA_VISIBLE_DEVICES, NGPUS, NCPUS), so the plan is the made-up job's on any machine, a GPU node's too.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PBS_", "SLURM_")) and k not in JOB_GPU_AND_CPU_VARIABLES}
    output = python("tools/launch.py", "--max-restarts", 0, "--dry-run", "scripts/tools/doctor.py",
                    env=env | job, echo=False)
    # The launcher's warnings compare the job's GPUs with what torch sees on this machine, which is not the job's node.
    output = "\n".join(line for line in output.strip().splitlines() if not line.startswith("launch.py: warning:"))
    plan = re.sub(r"^\S+(?= -m torch\.distributed\.run)", "python", output, flags=re.M)
    return plan, shlex.split(plan[plan.index("python -m"):].replace("\\\n", " "))
