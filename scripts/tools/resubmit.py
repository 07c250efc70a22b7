#!/usr/bin/env python3
"""Submit the follow-up of a PBS job whose run stopped before its walltime, to continue it.

    python scripts/tools/resubmit.py [--dry-run] CHECKPOINT_DIR

The course's PBS jobs call it (job_scripts/common.sh) when their run stopped on its time budget
(--stop-after: the walltime the job was granted) with a checkpoint. It reads the job from
`qstat -f -F json $PBS_JOBID` and submits the same job file again, as it was submitted:

  the file        the last word of Submit_arguments (relative to PBS_O_WORKDIR);
  resources       Resource_List's select, place and walltime (or, without select, every resource
                  but the ones PBS derives); the queue asked for (PBS_O_QUEUE), Account_Name,
                  project, Job_Name, and -j as Join_Path says;
  variables       every variable given with -v (Variable_List, without PBS's own PBS_O_*), plus
                  COURSE_CHECKPOINT_DIR=CHECKPOINT_DIR, so that the follow-up resumes from this
                  job's checkpoints, and COURSE_JOB_PART (1, 2, 3, ...: which job of the chain);
  log             PBS's default name (<job name>.o<job id>), or, where -o FILE was given, FILE.partN;
  order           -W depend=afterany:$PBS_JOBID: the follow-up waits until this job has ended,
                  however it ends, so two jobs never write one checkpoint folder at once.

It prints the follow-up's id; --dry-run prints the qsub command instead. Exit status 1 with one
line where PBS refuses (a site that does not let jobs submit jobs answers "Bad UID for job
execution"): the line says what to type on the login node instead.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys

# Resources PBS computes from select itself: asking for them too would conflict.
DERIVED = {"nodect", "ncpus", "mem", "mpiprocs", "ngpus", "ompthreads", "vmem", "nodes"}


class ResubmitError(Exception):
    """Why no follow-up could be submitted: one line for the job's log."""


def read_job(job_id):
    """The job's attributes, from qstat -f -F json."""
    try:
        done = subprocess.run(["qstat", "-f", "-F", "json", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ResubmitError(f"qstat -f {job_id} failed ({error})") from None
    if done.returncode != 0:
        raise ResubmitError(f"qstat -f {job_id} failed: {done.stderr.strip()}")
    jobs = json.loads(done.stdout).get("Jobs", {})
    if not jobs:
        raise ResubmitError(f"qstat -f {job_id} shows no job")
    return next(iter(jobs.values()))


def job_file(job):
    """The job file as it was submitted (relative to PBS_O_WORKDIR): the last word of Submit_arguments."""
    words = job.get("Submit_arguments", "").split()
    if not words or words[-1].startswith("-"):
        raise ResubmitError("qstat shows no job file in Submit_arguments (a job read from standard input?)")
    return words[-1]


def variable(name, value):
    """NAME=value for qsub -v; a value with a comma goes in quotes (qsub(1B): "the value must be enclosed in
    single or double quotes")."""
    value = str(value)
    if "," in value:
        quote = "'" if "'" not in value else '"'
        return f"{name}={quote}{value}{quote}"
    return f"{name}={value}"


def follow_up_command(job, job_id, checkpoint_dir):
    """The qsub command (a list of words) that continues ``job`` from ``checkpoint_dir`` once it has ended."""
    words = ["qsub", "-W", f"depend=afterany:{job_id}"]
    given = job.get("Variable_List", {})
    queue = given.get("PBS_O_QUEUE")
    if queue:
        words += ["-q", queue]
    resources = job.get("Resource_List", {})
    wanted = ["select", "place", "walltime"] if "select" in resources else [
        name for name in resources if name not in DERIVED]
    for name in wanted:
        if name in resources:
            words += ["-l", f"{name}={resources[name]}"]
    if job.get("Account_Name"):
        words += ["-A", job["Account_Name"]]
    if job.get("project") and job["project"] != "_pbs_project_default":
        words += ["-P", job["project"]]
    if job.get("Job_Name"):
        words += ["-N", job["Job_Name"]]
    if job.get("Join_Path") and job["Join_Path"] != "n":
        words += ["-j", job["Join_Path"]]
    part = int(given.get("COURSE_JOB_PART", "1")) + 1
    for option, key, suffix in (("-o", "Output_Path", "o"), ("-e", "Error_Path", "e")):
        path = job.get(key, "")
        default = re.search(rf"/{re.escape(job.get('Job_Name', ''))}\.{suffix}\d+$", path)
        if path and not default and not (option == "-e" and job.get("Join_Path", "n") != "n"):
            words += [option, f"{re.sub(r'[.]part[0-9]+$', '', path)}.part{part}"]
    variables = {name: value for name, value in given.items() if not name.startswith("PBS_O_")}
    variables.update(COURSE_CHECKPOINT_DIR=checkpoint_dir, COURSE_JOB_PART=part)
    words += ["-v", ",".join(variable(name, value) for name, value in variables.items())]
    return words + [job_file(job)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the qsub command, submit nothing")
    parser.add_argument("checkpoint_dir", help="the folder the follow-up resumes from (COURSE_CHECKPOINT_DIR)")
    args = parser.parse_args(argv)
    job_id = os.environ.get("PBS_JOBID")
    try:
        if not job_id:
            raise ResubmitError("PBS_JOBID is not set: this runs inside a PBS job")
        command = follow_up_command(read_job(job_id), job_id, args.checkpoint_dir)
        if args.dry_run:
            print(shlex.join(command))
            return 0
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            by_hand = ["qsub", *command[3:]]  # once this job has ended, no dependency is needed
            raise ResubmitError(f"{done.stderr.strip() or 'qsub failed'}; to continue by hand once this job has "
                                f"ended, from the course directory on the login node: {shlex.join(by_hand)}")
    except ResubmitError as error:
        print(f"resubmit.py: error: could not submit the follow-up: {error}", file=sys.stderr, flush=True)
        return 1
    print(f"== follow-up: job {done.stdout.strip()} continues from {args.checkpoint_dir} once job {job_id} has "
          f"ended ({shlex.join(command[:3])})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
