"""The batch schedulers' client commands, found where a job's processes can run them, and what they say of a job.
Kit: a learner may skip this module. No torch: the launcher uses it before torch loads.
"""
import os
import shutil
import subprocess

# What squeue says of a job that is over (Slurm keeps it listed for MinJobAge, 300 s by default).
SLURM_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
               "TIMEOUT"}


def pbs_command(name, env=None):
    """A PBS client command: on PATH, else in PBS_EXEC's bin/ (a pbsdsh task starts with PATH=/bin:/usr/bin);
    PBS_EXEC from the environment or the PBS configuration file, /etc/pbs.conf unless PBS_CONF_FILE says."""
    env = os.environ if env is None else env
    found = shutil.which(name)
    if found:
        return found
    exec_dir = env.get("PBS_EXEC")
    if not exec_dir:
        try:
            with open(env.get("PBS_CONF_FILE", "/etc/pbs.conf")) as conf:
                exec_dir = next((line.split("=", 1)[1].strip() for line in conf if line.startswith("PBS_EXEC=")), None)
        except OSError:
            return None
    path = os.path.join(exec_dir, "bin", name) if exec_dir else None
    return path if path and os.access(path, os.X_OK) else None


def job_ended(job):
    """True when the scheduler says ``job`` ('PBS 12.head', 'Slurm 345') is over, False while it is queued or runs
    (or is being ended), None when it cannot tell (no client command here, no answer)."""
    scheduler, _, job_id = (job or "").partition(" ")
    if scheduler == "PBS":
        command = pbs_command("qstat")
        words = [command, job_id]
    elif scheduler == "Slurm":
        command = shutil.which("squeue")
        words = [command, "--noheader", "--jobs", job_id, "--format", "%T"]
    else:
        return None
    if command is None:
        return None
    try:
        answer = subprocess.run(words, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    said = answer.stdout + answer.stderr
    if "Unknown Job Id" in said or "Job has finished" in said or "Invalid job id" in said:  # PBS, PBS's history, Slurm
        return True
    if answer.returncode != 0:
        return None
    if scheduler == "Slurm":
        return answer.stdout.strip() in SLURM_ENDED | {""}
    return False
