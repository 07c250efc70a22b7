"""Every PBS job in job_scripts/, submitted with qsub to a real OpenPBS with two hosts.

.ci/start_pbs.sh builds OpenPBS and starts it here: a server, a scheduler and a MoM on
host "pbshead", a second MoM on host "pbsnode2" (two network namespaces sharing one file
system, as cluster nodes share /home), a job user "pbsuser" (PBS runs no job as root),
and a Python environment that user can read. The tests work as that user would: a copy
of the course in the user's home, its .venv linked to that environment (site.sh's
first route), and every job submitted from there with `qsub -W block=true`, which
waits for the job and returns its exit status. What these 2-CPU hosts cannot give is
overridden on the qsub line (-l select=...), as a user at another site would, never by
editing a job, and never the job's GPU request: this PBS defines ngpus and grants each
job its GPUs (4 on each host, which do not exist), and the jobs run on CPUs because the
submissions set COURSE_CPU_FALLBACK=yes, as a site without GPUs would in site.sh (the
"gpus_unseen" variant shows the stop without it). All submissions go in at once; PBS
runs them as hosts come free.

Skipped, with the reason, where OpenPBS is not installed; failed where it is installed
but does not answer.

ADDING A JOB. Every job_scripts/*.pbs needs an entry in JOBS below, or
test_every_pbs_job_has_an_entry fails. An entry is a Submission:
  resources  what to ask qsub for instead of the job's #PBS lines: fitted(job, ncpus), the
             job's own select with the CPUs and memory of these hosts (2 CPUs each,
             24 GB) and its GPU request as shipped
  variables  qsub -v variables: COURSE_ARGS for a short run (short_run("<name>") trains
             3 steps and writes results/<name>.json), COURSE_LAUNCH_ARGS, site.sh settings;
             small offline data: --dataset synthetic-cifar10, or the ImageFolder and
             weights file in finetune-data/ of the course copy (tests/data_makers.py)
  record     fields the job's JSON record must hold (None: the job writes none); the
             data set is mnist5k unless the record names another
  log_has    text the job's output must contain
  check      optionally, a function(log, record) with more asserts
Then `sudo bash .ci/start_pbs.sh; .venv/bin/python -m pytest tests/test_pbs.py`.
"""
import json
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from cluster_helpers import (
    BATCH_TIMEOUT,
    JOB_SCRIPTS,
    STAND_INS,
    clean_environment,
    copy_course_for,
    pbs_as_root,
    pbs_as_user,
    pbs_setup,
    read_record,
    wait_for_file,
)
from data_makers import write_image_folder, write_resnet18_weights
from kit.checkpoints import checkpoints_in

SETUP, NO_PBS = pbs_setup()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BATCH_TIMEOUT),
              pytest.mark.skipif(SETUP is None, reason=NO_PBS or "")]

HEAD, NODE2 = (SETUP or {}).get("PBS_HOSTS", "pbshead pbsnode2").split()
JOB_SECONDS = 600  # a hang guard: how long a wait goes without news of a job before it gives up


def job_select(job):
    return re.search(r"^#PBS -l (select=\S+)$", (JOB_SCRIPTS / job).read_text(), re.M)[1]


def fitted(job, ncpus, *more, ngpus=None):
    """qsub -l resources for JOB on these hosts: its own select with NCPUS CPUs and 4 GB a chunk and the GPUs it
    asks for (a variant that tests something else may ask for NGPUS a chunk), a walltime of 10 minutes, MORE."""
    select = re.sub(r"(?<=:)ncpus=\d+", f"ncpus={ncpus}", re.sub(r"(?<=:)mem=\w+", "mem=4gb", job_select(job)))
    if ngpus is not None:
        select = re.sub(r"(?<=:)ngpus=\d+", f"ngpus={ngpus}", select)
    return (select, *more, "walltime=00:10:00")


def granted_on_cpus(*hosts, gpus=2):
    """The launcher's line, on each of HOSTS (regular expressions), for GPUs this PBS granted and torch cannot see."""
    return tuple(re.compile(
        rf"^launch.py: warning: the job was granted {gpus} GPU\(s\) on (?P<host>{host}) \(ngpus={gpus} on (?P=host) in "
        r"the job's exec_vnode \(qstat -f\)\) but torch sees none: running on CPUs, as COURSE_CPU_FALLBACK=yes in "
        r"job_scripts/site.sh allows$", re.M) for host in hosts)


ANY_HOST = f"{HEAD}|{NODE2}"  # where PBS runs a one-host job


SYNTHETIC_CIFAR = "--dataset synthetic-cifar10 --batch-size 16"
FINETUNE_DATA = "finetune-data"  # in the course copy: an ImageFolder and a weights file (tests/data_makers.py)


def short_run(name, extra=""):
    """COURSE_ARGS for a short training run whose record is results/<name>.json."""
    return f"--epochs 1 --max-steps 3 --run-name {name} {extra}".strip()


@dataclass(frozen=True)
class Submission:
    job: str  # the file in job_scripts/
    resources: tuple  # qsub -l, for these hosts
    variables: dict = field(default_factory=dict)  # qsub -v
    record: dict | None = None  # fields results/<run name>.json must hold; None: no record
    log_has: tuple = ()  # text, or a compiled regular expression to search for
    exit_status: int = 0
    check: Callable | None = None  # check(log, record): anything more

    @property
    def run_name(self):
        """The --run-name in COURSE_ARGS: the record is results/<run name>.json."""
        words = self.variables.get("COURSE_ARGS", "").split()
        return words[words.index("--run-name") + 1] if "--run-name" in words else None


def preflight(ranks, layout):
    return f"pre-flight all_reduce ok: {ranks} rank(s) on {len(layout)} node(s): " + ", ".join(
        f"{host} [{ranks_on_host}]" for host, ranks_on_host in layout)


# One entry per job file: what it takes to run here and what it must show.
JOBS = {
    "01_baseline.pbs": Submission(
        "01_baseline.pbs", fitted("01_baseline.pbs", 1), {"COURSE_ARGS": short_run("01_baseline")},
        record={"script": "step1_baseline", "world_size": 1, "device": "cpu"},
        log_has=granted_on_cpus(ANY_HOST, gpus=1) + ("processes   1 per node",),
    ),
    "02_allreduce.pbs": Submission(
        "02_allreduce.pbs", fitted("02_allreduce.pbs", 2), {"COURSE_ARGS": short_run("02_allreduce")},
        record={"script": "step2_allreduce", "world_size": 2},
        log_has=(re.compile(rf"processes   2 per node   one per GPU granted, on CPUs: ngpus=2 on ({ANY_HOST}) "),
                 "pre-flight all_reduce ok: 2 rank(s) on 1 node(s)", *granted_on_cpus(ANY_HOST)),
    ),
    "03_data_parallel.pbs": Submission(
        "03_data_parallel.pbs", fitted("03_data_parallel.pbs", 1), {"COURSE_ARGS": short_run("03_data_parallel")},
        record={"script": "step3_data_parallel", "world_size": 1},
    ),
    # Four processes on one host: the same run as the 2-node job's (compared below).
    "04_ddp.pbs": Submission(
        "04_ddp.pbs", fitted("04_ddp.pbs", 2),
        {"COURSE_ARGS": short_run("04_ddp"), "COURSE_LAUNCH_ARGS": "--nproc-per-node 4"},
        record={"script": "step4_ddp", "world_size": 4},
        log_has=("pre-flight all_reduce ok: 4 rank(s) on 1 node(s)",),
    ),
    "04_ddp_2nodes.pbs": Submission(
        "04_ddp_2nodes.pbs", fitted("04_ddp_2nodes.pbs", 2), {"COURSE_ARGS": short_run("04_ddp_2nodes")},
        record={"script": "step4_ddp", "world_size": 4},
        log_has=(*granted_on_cpus(HEAD, NODE2),
            f"== pbsdsh: node_launch.sh on 2 node(s): {HEAD} {NODE2}",
            "this node   0 of 2", "this node   1 of 2", "PBS_NODENUM=1 agrees",
            preflight(4, [(HEAD, "0-1"), (NODE2, "2-3")]),
            f"== node 0 ({HEAD}): exit status 0", f"== node 1 ({NODE2}): exit status 0",
        ),
    ),
    # JupyterLab on the job's host, told to stop when idle (Jupyter looks once a minute): the
    # server really started there, named its tunnel, and ended the job by itself.
    # CIFAR-10 with ResNet-18 (the Palmetto DDP tutorial), on CIFAR-shaped images made up in memory.
    "06_cifar10_baseline.pbs": Submission(
        "06_cifar10_baseline.pbs", fitted("06_cifar10_baseline.pbs", 1),
        {"COURSE_ARGS": short_run("06_cifar10_baseline", SYNTHETIC_CIFAR)},
        record={"script": "step1_baseline", "world_size": 1, "dataset": "synthetic-cifar10", "model": "resnet18"},
        log_has=(re.compile(r"^total \d+\.\d s; record written to results/06_cifar10_baseline\.json", re.M),),
    ),
    "06_cifar10_ddp.pbs": Submission(
        "06_cifar10_ddp.pbs", fitted("06_cifar10_ddp.pbs", 2),
        {"COURSE_ARGS": short_run("06_cifar10_ddp", SYNTHETIC_CIFAR)},
        record={"script": "step4_ddp", "world_size": 2, "dataset": "synthetic-cifar10", "model": "resnet18"},
        log_has=("pre-flight all_reduce ok: 2 rank(s) on 1 node(s)", "record written to results/06_cifar10_ddp.json"),
    ),
    "06_cifar10_ddp_2nodes.pbs": Submission(
        "06_cifar10_ddp_2nodes.pbs", fitted("06_cifar10_ddp_2nodes.pbs", 1),
        {"COURSE_ARGS": short_run("06_cifar10_ddp_2nodes", SYNTHETIC_CIFAR)},
        record={"script": "step4_ddp", "world_size": 4, "dataset": "synthetic-cifar10", "model": "resnet18"},
        log_has=(preflight(4, [(HEAD, "0-1"), (NODE2, "2-3")]), f"== node 1 ({NODE2}): exit status 0"),
    ),
    # The fine-tune (the SageMaker DDP tutorial) from a weights file, on a small ImageFolder of PNG digits.
    "06_finetune_2nodes.pbs": Submission(
        "06_finetune_2nodes.pbs", fitted("06_finetune_2nodes.pbs", 1),
        {"COURSE_ARGS": short_run("06_finetune_2nodes",
                                  f"--data-dir {FINETUNE_DATA}/imagefolder "
                                  f"--weights {FINETUNE_DATA}/resnet18-weights.pt --batch-size 4")},
        record={"script": "step6_finetune", "world_size": 4, "dataset": "imagefolder", "model": "resnet18"},
        log_has=("--finetune head: 1,026 of 11,177,538 parameters train",
                 preflight(4, [(HEAD, "0-1"), (NODE2, "2-3")])),
    ),
    # DDP with model parallelism (the official DDP tutorial): 2 GPUs granted, one replica; on CPUs, both halves on
    # the CPU.
    "06_model_parallel.pbs": Submission(
        "06_model_parallel.pbs", fitted("06_model_parallel.pbs", 2),
        {"COURSE_ARGS": short_run("06_model_parallel", SYNTHETIC_CIFAR)},
        record={"script": "step6_model_parallel", "world_size": 1, "dataset": "synthetic-cifar10"},
        log_has=(re.compile(rf"processes   1 per node   one per 2 GPUs granted, on CPUs: ngpus=2 on ({ANY_HOST}) "),
                 "each replica: conv1, bn1, relu, maxpool, layer1, layer2 on cpu; layer3, layer4, avgpool, fc on cpu",),
    ),
    # The cluster doctor on both hosts, as launched by default: one rank per GPU granted, 2 on each host's 2 cores. It
    # names both hosts, notes the cores and the CPU fall-back, and diagnoses nothing.
    "doctor.pbs": Submission(
        "doctor.pbs", fitted("doctor.pbs", 2),
        log_has=(f"doctor: 4 rank(s) on 2 node(s): {HEAD} [0-1], {NODE2} [2-3]",
                 f"job's hosts: PBS_NODEFILE: {HEAD}, {NODE2}",
                 re.compile(rf"^0 +{HEAD} +0 +0 +none +unset +", re.M),
                 re.compile(rf"^3 +{NODE2} +1 +1 +none +unset +", re.M),
                 *(f"note: one CPU core per rank: {host} runs 2 rank(s) on 2 CPU core(s) (NCPUS=2)"
                   for host in (HEAD, NODE2)),
                 *(f"note: GPUs granted but unseen: {host} was granted 2 GPU(s) (ngpus=2 on {host} in the job's "
                   "exec_vnode (qstat -f)) but torch sees none: running on CPUs (COURSE_CPU_FALLBACK=yes)"
                   for host in (HEAD, NODE2)),
                 "all_reduce with gloo: the sum of ones is 4, the world size",
                 "probe between 2 nodes: all_reduce of 16 MiB",
                 "doctor: no problem found (4 notes)", f"== node 0 ({HEAD}): exit status 0",
                 f"== node 1 ({NODE2}): exit status 0"),
        check=lambda log, record: doctor_diagnosed(log, []),
    ),
    "jupyter.pbs": Submission(
        "jupyter.pbs", fitted("jupyter.pbs", 1), {"COURSE_JUPYTER_IDLE_SECONDS": "5"},
        log_has=(re.compile(rf"== JupyterLab on ({HEAD}|{NODE2}), port \d+, serving "),
                 re.compile(rf"ssh -N -L (\d+):({HEAD}|{NODE2}):\1 pbsuser@"), "No kernels for",
                 re.compile(rf"^launch.py: warning: the job was granted 2 GPU\(s\) on ({HEAD}|{NODE2}) .* running on "
                            "CPUs, as COURSE_CPU_FALLBACK=yes", re.M)),
    ),
}

MODULES = "course-modules"  # a folder in the course copy with the module files the tests write


def not_trained(log):
    assert "torch.distributed.run" not in log and "pre-flight" not in log, log


def same_python_on_every_node(python):
    """A check: the job shell and both nodes' tasks ran PYTHON."""
    def check(log, record):
        assert f"== python: {python} " in log
        assert f"== node 0: {HEAD}, python {python}" in log and f"== node 1: {NODE2}, python {python}" in log
    return check


def doctor_diagnosed(log, expected):
    """The doctor's diagnosis lines are exactly ``expected`` (regular expressions, in order)."""
    found = re.findall(r"^diagnosis: (.*)$", log, re.M)
    assert len(found) == len(expected) and all(re.match(pattern, line) for pattern, line in zip(expected, found)), (
        f"expected {expected}, got {found}\n{log}")


# Not job files: the same jobs, other ways. Each has a name of its own. The 2-node ones ask for one GPU a host (one
# rank each): what they test is not the GPU request, which JOBS runs as shipped.
ONE_GPU_A_HOST = fitted("04_ddp_2nodes.pbs", 1, ngpus=1)
VARIANTS = {
    # site.sh's module route: a module (Lmod, written by the test) puts the Python on PATH.
    "modules": lambda venv, copy: Submission(
        "04_ddp_2nodes.pbs", ONE_GPU_A_HOST,
        {"COURSE_ARGS": short_run("modules"), "COURSE_MODULES": "course-python/1.0",
         "COURSE_MODULE_PATH": f"{copy}/{MODULES}", "COURSE_VENV": "", "COURSE_CONDA_ENV": ""},
        record={"script": "step4_ddp", "world_size": 2},
        log_has=("== modules: course-python/1.0", preflight(2, [(HEAD, "0"), (NODE2, "1")])),
        check=same_python_on_every_node(f"{venv}/bin/python"),
    ),
    # site.sh's conda route: a module provides conda (a stand-in), which activates ddp-course.
    "conda": lambda venv, copy: Submission(
        "04_ddp_2nodes.pbs", ONE_GPU_A_HOST,
        {"COURSE_ARGS": short_run("conda"), "COURSE_MODULES": "conda/test", "COURSE_MODULE_PATH": f"{copy}/{MODULES}",
         "COURSE_VENV": "", "COURSE_CONDA_ENV": "ddp-course"},
        record={"script": "step4_ddp", "world_size": 2},
        log_has=(preflight(2, [(HEAD, "0"), (NODE2, "1")]),),
        check=same_python_on_every_node(f"{copy}/conda/envs/ddp-course/bin/python"),
    ),
    # A training that fails fails the job, and a failure on the nodes fails the 2-node job.
    "fails": lambda venv, copy: Submission(
        "01_baseline.pbs", fitted("01_baseline.pbs", 1), {"COURSE_ARGS": short_run("fails", "--epochs 0")},
        # torchrun tries the group of one again (--max-restarts), then fails with its own status, 1.
        exit_status=1,
        log_has=("step1_baseline.py: error: argument --epochs: must be at least 1, got 0", "== exit status 1"),
    ),
    "fails_on_the_nodes": lambda venv, copy: Submission(
        "04_ddp_2nodes.pbs", ONE_GPU_A_HOST,
        {"COURSE_ARGS": short_run("fails_on_the_nodes", "--epochs 0"), "COURSE_LAUNCH_ARGS": "--max-restarts 0"},
        exit_status=1, log_has=("== node 0 (", "== node 1 (", "training failed on at least one node"),
    ),
    # A worker killed mid-run: torchrun restarts the group on both hosts, and it resumes.
    "worker_killed": lambda venv, copy: Submission(
        "04_ddp_2nodes.pbs", ONE_GPU_A_HOST,
        {"COURSE_ARGS": short_run("worker_killed", "--checkpoint-every 1 --fault kill --fault-rank 1 --fault-step 2")},
        record={"script": "step4_ddp", "world_size": 2, "resumed_at_step": 2},
        log_has=("fault drill: rank 1 kills itself (SIGKILL) after step 2",
                 re.compile(r"resumed from checkpoints/ddp04_2nodes-\d+\.\S+/checkpoint-00000002\.pt: "
                            r"epoch 1, 2 of \d+ batches done"),
                 "== node 0 (", "== node 1 (", "exit status 0"),
    ),
    # The doctor in a job whose two chunks PBS packed on one host: the node file lists that host twice, which fails
    # the job (the job has NCPUS=1 there, one chunk's ncpus: one core for its one rank, a note).
    "doctor_packed": lambda venv, copy: Submission(
        "doctor.pbs", fitted("doctor.pbs", 1, "place=pack"), {"COURSE_LAUNCH_ARGS": "--nproc-per-node 1"},
        exit_status=1,
        log_has=(re.compile(rf"^doctor: 1 rank\(s\) on 1 node\(s\): ({HEAD}|{NODE2}) \[0\]$", re.M),
                 re.compile(rf"^note: one CPU core per rank: ({HEAD}|{NODE2}) runs 1 rank\(s\) on 1 CPU core\(s\) "
                            r"\(NCPUS=1\), ", re.M),
                 re.compile(r"^doctor: 1 problem\(s\) found \(2 notes\), exit status 1$", re.M)),
        check=lambda log, record: doctor_diagnosed(log, [
            rf"a host listed twice: PBS_NODEFILE lists ({HEAD}|{NODE2}) 2 times: "]),
    ),
    # GPUs granted that torch cannot see, on a site that does not allow the fall-back to CPUs (site.sh's default):
    # each node's launcher stops the job before training, in one line.
    "gpus_unseen": lambda venv, copy: Submission(
        "04_ddp_2nodes.pbs", fitted("04_ddp_2nodes.pbs", 1),
        {"COURSE_ARGS": short_run("gpus_unseen"), "COURSE_CPU_FALLBACK": "no"}, exit_status=1,
        log_has=tuple(f"launch.py: error: the job was granted 2 GPU(s) on {host} (ngpus=2 on {host} in the job's "
                      "exec_vnode (qstat -f)) but torch sees none: " for host in (HEAD, NODE2))
        + ("A site without GPUs: COURSE_CPU_FALLBACK=yes in job_scripts/site.sh, or submit without the GPU request",
           f"== node 0 ({HEAD}): exit status 2", f"== node 1 ({NODE2}): exit status 2",
           "training failed on at least one node"),
        check=lambda log, record: not_trained(log),
    ),
    # Two chunks packed on one host: refused before pbsdsh starts two launchers there.
    "packed": lambda venv, copy: Submission(
        "04_ddp_2nodes.pbs", fitted("04_ddp_2nodes.pbs", 1, "place=pack"),
        {"COURSE_ARGS": short_run("packed")},
        exit_status=1,
        log_has=(re.compile(r"job: error: PBS_NODEFILE lists a host more than once \((\S+) \1\), so pbsdsh "
                            r"would start two launchers on it; ask for one chunk per host"),),
    ),
}


# ---------------------------------------------------------------- the PBS, the course copy, the jobs

@pytest.fixture(scope="module")
def pbs():
    answer = pbs_as_root(SETUP, "qstat", "-Bf")
    if answer.returncode != 0:
        pytest.fail(f"OpenPBS is installed but its server does not answer ({answer.stderr.strip()}); "
                    "start it: sudo bash .ci/start_pbs.sh")
    nodes = pbs_as_root(SETUP, "pbsnodes", "-a").stdout
    states = dict(re.findall(r"^(\S+)\n\s+Mom = .*?\n(?:.*\n)*?\s+state = (\S+)", nodes, re.M))
    if set(states) != {HEAD, NODE2} or any(state not in ("free", "job-busy") for state in states.values()):
        pytest.fail(f"the PBS nodes are not both up: {states}; see sudo bash .ci/start_pbs.sh status")
    if not re.search(r"^\s+scheduling = True$", answer.stdout, re.M):  # a test paused it, and was cut short
        pytest.fail("the PBS scheduler is paused (qmgr: scheduling = False); sudo bash .ci/start_pbs.sh starts it")
    return SETUP


def write_module(folder, name, lua):
    path = folder / f"{name}.lua"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(lua)


@pytest.fixture(scope="module")
def course(pbs):
    """The course in the job user's home, with .venv, module files and a conda stand-in; removed after."""
    user, venv = pbs["PBS_JOB_USER"], pbs["PBS_JOB_VENV"]
    copy = Path(pbs["PBS_JOB_HOME"]) / f"course-test-{time.strftime('%H%M%S')}"
    copy.mkdir()
    (copy / ".venv").symlink_to(venv)
    # Site modules, as a site's module tree would hold them.
    write_module(copy / MODULES, "course-python/1.0",
                 f'whatis("Python with torch, for the course")\nprepend_path("PATH", "{venv}/bin")\n')
    write_module(copy / MODULES, "conda/test", f'whatis("conda")\nprepend_path("PATH", "{copy}/conda/bin")\n')
    # A conda installation: the stand-in command and one environment, the job environment.
    (copy / "conda" / "bin").mkdir(parents=True)
    (copy / "conda" / "envs").mkdir()
    shutil.copy2(STAND_INS / "conda", copy / "conda" / "bin" / "conda")
    (copy / "conda" / "envs" / "ddp-course").symlink_to(venv)
    (copy / "logs").mkdir()
    write_image_folder(copy / FINETUNE_DATA / "imagefolder")
    write_resnet18_weights(copy / FINETUNE_DATA / "resnet18-weights.pt")
    copy_course_for(user, copy)
    yield copy
    shutil.rmtree(copy)


def qsub_line(copy, name, submission, block=True, hold=False):
    words = ["qsub"] + (["-W", "block=true"] if block else []) + (["-h"] if hold else [])
    for resource in submission.resources:
        words += ["-l", resource]
    variables = {"COURSE_CPU_FALLBACK": "yes", **submission.variables}  # GPUs granted here do not exist
    words += ["-v", ",".join(f"{key}={value}" for key, value in variables.items())]
    words += ["-o", f"{copy}/logs/{name}.log", f"job_scripts/{submission.job}"]
    return f"cd {shlex.quote(str(copy))} && {shlex.join(words)}"


@pytest.fixture(scope="module")
def finished(pbs, course):
    """Submit every entry of JOBS and VARIANTS at once, each with qsub -W block=true; wait for all."""
    venv = pbs["PBS_JOB_VENV"]
    submissions = {name: submission for name, submission in JOBS.items() if (JOB_SCRIPTS / name).exists()}
    submissions |= {name: make(venv, course) for name, make in VARIANTS.items()}
    running = {
        name: subprocess.Popen([pbs["PBS_USER_COMMAND"], qsub_line(course, name, submission)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, submission in submissions.items()
    }
    answers = answers_of(running, pbs)
    results = {}
    for name, process in running.items():
        log = wait_for_file(course / "logs" / f"{name}.log") or "(no job output file)"
        record_path = course / "results" / f"{submissions[name].run_name}.json"
        record = read_record(record_path) if record_path.exists() else None
        results[name] = (process.returncode, answers[name], log, record)
    return submissions, results


def answers_of(running, pbs):
    """What each `qsub -W block=true` printed, once it returned. A hang guard, not a time limit: the jobs share two
    hosts and a loaded machine stretches each of them, so the wait gives up only when no submission has returned
    for JOB_SECONDS; then it stops the ones left and deletes their jobs."""
    answers, last_answer = {}, time.monotonic()
    while len(answers) < len(running):
        for name, process in running.items():
            if name not in answers and process.poll() is not None:
                answers[name], last_answer = process.communicate()[0], time.monotonic()
        if len(answers) < len(running) and time.monotonic() - last_answer > JOB_SECONDS:
            for name, process in running.items():
                if name not in answers:
                    process.kill()
                    output = process.communicate()[0]
                    job_id = output.split()[0] if output.strip() else ""
                    if job_id:
                        pbs_as_root(pbs, "qdel", "-W", "force", job_id)
                    answers[name] = (output + f"\n(no answer from qsub -W block=true, nor from any other, for "
                                              f"{JOB_SECONDS} s)")
        time.sleep(1)
    return answers


def check_submission(finished, name):
    submissions, results = finished
    submission = submissions[name]
    status, qsub_output, log, record = results[name]
    context = f"qsub: {qsub_output}\n--- job output:\n{log}"
    assert status == submission.exit_status, context
    for text in submission.log_has:
        found = text.search(log) if isinstance(text, re.Pattern) else text in log
        assert found, f"missing {text!r}\n{context}"
    if submission.record is not None:
        assert record is not None, f"no JSON record\n{context}"
        assert {key: record.get(key) for key in submission.record} == submission.record, context
        assert record["dataset"] == submission.record.get("dataset", "mnist5k") and len(record["per_epoch"]) == 1
    if submission.check:
        submission.check(log, record)
    return log, record


# ---------------------------------------------------------------- the checks

def test_every_pbs_job_has_an_entry():
    missing = sorted({path.name for path in JOB_SCRIPTS.glob("*.pbs")} - set(JOBS))
    assert not missing, f"add an entry to JOBS in tests/test_pbs.py for: {missing} (the module docstring says how)"


@pytest.mark.parametrize("name", sorted(JOBS))
def test_job_runs_on_real_pbs(finished, course, name):
    if not (JOB_SCRIPTS / name).exists():
        pytest.skip(f"job_scripts/{name} is gone; remove its entry from JOBS")
    log, record = check_submission(finished, name)
    assert "== job " in log and "== torch " in log and "== python: " in log
    if record is not None:  # a training job: --resume into a checkpoint folder of its own
        folder = re.search(r"^== checkpoints: (checkpoints/\S+-\d+\.\S+) ", log, re.M)
        assert folder and f"no checkpoint in {folder[1]} yet: starting fresh" in log, log
        assert list((course / folder[1]).glob("checkpoint-*.pt")), f"no checkpoint in {folder[1]}"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_job_variant_on_real_pbs(finished, name):
    check_submission(finished, name)


def test_two_hosts_train_like_one_host_with_as_many_processes(finished):
    _, results = finished
    two, one = results["04_ddp_2nodes.pbs"][3], results["04_ddp.pbs"][3]
    assert two and one, "both runs must have written a record"
    assert two["world_size"] == one["world_size"] == 4 and two["global_batch_size"] == one["global_batch_size"]
    # The same ranks see the same shards with the same seeds; only where they run differs.
    assert two["final_test_loss"] == pytest.approx(one["final_test_loss"], rel=1e-4)
    assert two["per_epoch"][0]["train_loss"] == pytest.approx(one["per_epoch"][0]["train_loss"], rel=1e-4)


def test_the_two_node_job_cleans_up_its_job_folder(finished, course):
    assert not list(course.glob(".pbs_job.*"))


@pytest.mark.parametrize("job", sorted(path.name for path in JOB_SCRIPTS.glob("*.pbs")))
def test_qsub_takes_the_job_unedited(pbs, course, job):
    """A PBS with ngpus, as GPU sites have, takes every job as it is: held (-h), so it never runs, then deleted."""
    answer = pbs_as_user(pbs, f"cd {shlex.quote(str(course))} && qsub -h job_scripts/{job}")
    assert answer.returncode == 0, answer.stderr
    pbs_as_root(pbs, "qdel", answer.stdout.strip())


def test_this_pbs_knows_ngpus_and_nothing_site_specific_so_the_check_above_can_fail(pbs, course):
    nodes = pbs_as_root(pbs, "pbsnodes", "-a").stdout
    assert nodes.count("resources_available.ngpus = 4") == 2, nodes
    answer = pbs_as_user(pbs, f"cd {shlex.quote(str(course))} && "
                              "qsub -h -l select=1:ncpus=1:ngpus=1:gpu_model=a100 job_scripts/01_baseline.pbs")
    assert answer.returncode != 0 and "Unknown resource: gpu_model" in answer.stderr


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_submissions_keep_each_jobs_gpu_request(name):
    """CI fits CPUs, memory and walltime to these hosts, never the GPUs a job asks for."""
    gpus = re.compile(r"(?<=:)ngpus=\d+")
    shipped = gpus.findall(job_select(name))
    assert shipped and [gpus.findall(r) for r in JOBS[name].resources if r.startswith("select=")] == [shipped]


# ---------------------------------------------------------------- launch.py under the real pbsdsh

PROBE = """#!/bin/bash
#PBS -N probe
#PBS -j oe
# Each pbsdsh task runs the launcher's dry run, as node_launch.sh would run it.
cd "$PBS_O_WORKDIR"
cp "$PBS_NODEFILE" "logs/nodefile.$PBS_JOBID"
pbsdsh -- /bin/bash -c "cd $PWD && PBS_NODEFILE=$PWD/logs/nodefile.$PBS_JOBID \\
    .venv/bin/python scripts/tools/launch.py --dry-run scripts/step4_ddp.py"
"""


@pytest.fixture(scope="module")
def launcher_under_pbsdsh(pbs, course):
    """The launcher's dry run in every pbsdsh task of a 2-host job and of a job packed on one host."""
    (course / "logs" / "probe.pbs").write_text(PROBE)
    subprocess.run(["chown", f"{pbs['PBS_JOB_USER']}:", str(course / "logs" / "probe.pbs")], check=True)
    logs = {}
    for place in ("scatter", "pack"):
        line = (f"cd {shlex.quote(str(course))} && qsub -W block=true -l select=2:ncpus=1:mpiprocs=1 "
                f"-l place={place} -o logs/probe-{place}.log logs/probe.pbs")
        pbs_as_user(pbs, line, timeout=300)
        logs[place] = wait_for_file(course / "logs" / f"probe-{place}.log") or ""
    return logs


def test_launcher_under_pbsdsh_takes_each_hosts_place(launcher_under_pbsdsh):
    log = launcher_under_pbsdsh["scatter"]
    assert re.search(rf"this node +0 of 2 +{HEAD}'s place in PBS_NODEFILE; PBS_NODENUM=0 agrees", log), log
    assert re.search(rf"this node +1 of 2 +{NODE2}'s place in PBS_NODEFILE; PBS_NODENUM=1 agrees", log), log
    assert log.count("--rdzv-conf=is_host=1") == 1 and log.count("--rdzv-conf=is_host=0") == 1, log


def test_launcher_under_pbsdsh_refuses_two_tasks_on_one_host(launcher_under_pbsdsh):
    log = launcher_under_pbsdsh["pack"]
    errors = re.findall(r"launch.py: error: PBS_NODEFILE lists (\S+) 2 times, so pbsdsh starts 2 launchers there", log)
    assert len(errors) == 2 and errors[0] in (HEAD, NODE2), log  # both tasks, each with one line
    assert "torch.distributed.run" not in log


# ---------------------------------------------------------------- an interactive session

def test_interactive_session_with_qsub_i(pbs, course):
    """qsub -I wants a terminal: `script` gives it one, and the commands go in on standard input."""
    commands = "\n".join([
        'cd "$PBS_O_WORKDIR"',
        "source .venv/bin/activate",
        "python scripts/tools/launch.py --dry-run scripts/step4_ddp.py",
        f"python scripts/step1_baseline.py {short_run('interactive')}",
        'echo "training exit status $?"',
        "exit",
    ]) + "\n"
    qsub = "qsub -I -l select=1:ncpus=1:mem=4gb -l walltime=00:10:00"
    answer = pbs_as_user(pbs, f"cd {shlex.quote(str(course))} && script -qec {shlex.quote(qsub)} /dev/null",
                         stdin=commands, timeout=300)
    output = answer.stdout.replace("\r", "")
    assert answer.returncode == 0, output + answer.stderr
    assert re.search(r"qsub: job \d+\.\S+ ready", output), output
    assert re.search(r"launch.py: PBS job \d+\.\S+\n  hosts +" + HEAD, output), output
    assert "training exit status 0" in output and re.search(r"qsub: job \d+\.\S+ completed", output), output
    assert read_record(course / "results" / "interactive.json")["script"] == "step1_baseline"


# ---------------------------------------------------------------- a job run again: qrerun

def test_a_rerun_job_resumes_from_its_checkpoint(pbs, course):
    """qrerun kills a running job and queues it again under the same id: it resumes."""
    # Rank 0 stalls after step 2 (its checkpoint written), so the job is surely running then.
    run = short_run("rerun", "--max-steps 4 --checkpoint-every 1 --fault stall --fault-step 2 --fault-seconds 600")
    submission = Submission("04_ddp.pbs", fitted("04_ddp.pbs", 2), {"COURSE_ARGS": run})
    line = qsub_line(course, "rerun", submission).replace("qsub ", "qsub -N rerun_test ", 1)
    waiting = subprocess.Popen([pbs["PBS_USER_COMMAND"], line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        for _ in range(1200):
            written = list((course / "checkpoints").glob("rerun_test-*/checkpoint-00000002.pt"))
            if written or waiting.poll() is not None:
                break
            time.sleep(0.2)
        assert written, f"no checkpoint after step 2 within 4 minutes: {waiting.poll()}"
        job_id = written[0].parent.name.removeprefix("rerun_test-")
        rerun = pbs_as_root(pbs, "qrerun", job_id)
        assert rerun.returncode == 0, rerun.stderr
        output, _ = waiting.communicate(timeout=300)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    log = wait_for_file(course / "logs" / "rerun.log") or ""
    assert waiting.returncode == 0, output + log
    assert f"resumed from checkpoints/rerun_test-{job_id}/checkpoint-00000002.pt: epoch 1, 2 of" in log, log
    record = read_record(course / "results" / "rerun.json")
    assert record["resumed_at_step"] == 2 and record["world_size"] == 2


def test_qstat_tells_a_checkpoint_folders_lock_whether_its_job_has_ended(pbs, course):
    """A lock left on a checkpoint folder by a job that died is taken over once qstat says the job is over
    (machinery/folder_lock.py, kit/schedulers.py): held while the job is queued, at once after qdel. Asked as the
    job user on the login node, with the course's Python, as a job's rank 0 asks."""
    held = pbs_as_user(pbs, f"cd {shlex.quote(str(course))} && qsub -h -N lock_test -l select=1:ncpus=1:mem=1gb "
                            f"-l walltime=00:01:00 -- /bin/true")
    assert held.returncode == 0, held.stderr
    job = f"PBS {held.stdout.strip()}"
    ask = (f"cd {shlex.quote(str(course / 'scripts'))} && {pbs['PBS_JOB_VENV']}/bin/python -c "
           f"{shlex.quote(f'from kit import schedulers; print(schedulers.job_ended({job!r}))')}")
    try:
        assert pbs_as_user(pbs, ask).stdout.strip() == "False"
    finally:
        assert pbs_as_root(pbs, "qdel", job.split()[1]).returncode == 0
    deadline = time.monotonic() + 60
    while (said := pbs_as_user(pbs, ask).stdout.strip()) != "True" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert said == "True"


# ---------------------------------------------------------------- the walltime, and qdel: nothing lost

# 2 epochs of 60 steps of the Net in 2 processes, one thread each: the run both jobs below train, and the
# reference they must end with, bit for bit.
LONG_RUN = "--epochs 2 --max-steps 60 --batch-size 32 --threads 1"
ON_CPUS = {"COURSE_CPU_FALLBACK": "yes"}  # 04_ddp.pbs's 2 GPUs, granted, do not exist: 2 processes on one CPU


def job_state(pbs, job_id):
    """'Q', 'R', 'E', 'H', ... or 'F' (finished, from the job history)."""
    answer = pbs_as_root(pbs, "qstat", "-x", "-f", "-F", "json", job_id)
    jobs = json.loads(answer.stdout).get("Jobs", {}) if answer.returncode == 0 and answer.stdout.strip() else {}
    return next(iter(jobs.values()), {}).get("job_state", "F")


def jobs_named(pbs, name):
    """The ids of the jobs called ``name`` that are queued, held or running."""
    answer = pbs_as_root(pbs, "qstat", "-f", "-F", "json")
    jobs = json.loads(answer.stdout).get("Jobs", {}) if answer.returncode == 0 and answer.stdout.strip() else {}
    return [job_id for job_id, job in jobs.items() if job.get("Job_Name") == name]


def submit(pbs, course, name, resources, variables):
    words = ["qsub", "-N", name, *[part for resource in resources for part in ("-l", resource)],
             "-v", ",".join(f"{key}={value}" for key, value in variables.items()), "-o", f"{course}/logs/{name}.log",
             "job_scripts/04_ddp.pbs"]
    answer = pbs_as_user(pbs, f"cd {shlex.quote(str(course))} && {shlex.join(words)}")
    assert answer.returncode == 0, answer.stderr
    return answer.stdout.strip()


def submit_to(pbs, host, course, name, resources, variables):
    """submit(), and the job started on HOST by the test (qrun -H, once no job is left there), the scheduler paused
    meanwhile, so that no other job starts there in between: its request names no host, so the follow-ups it asks
    for land wherever PBS puts them."""
    assert pbs_as_root(pbs, "qmgr", "-c", "set server scheduling = False").returncode == 0
    try:
        deadline = time.monotonic() + JOB_SECONDS
        while re.search(r"^\s+jobs = ", nodes := pbs_as_root(pbs, "pbsnodes", host).stdout, re.M):
            assert time.monotonic() < deadline, nodes  # the jobs running there end; none starts meanwhile
            time.sleep(0.5)
        job_id = submit(pbs, course, name, resources, variables)
        started = pbs_as_root(pbs, "qrun", "-H", f"({host})", job_id)
        assert started.returncode == 0, started.stderr
    finally:
        pbs_as_root(pbs, "qmgr", "-c", "set server scheduling = True")
    return job_id


def finished_job(pbs, job_id):
    """The job's attributes once it has finished (qstat -x: job_state F), or None: not yet, or no answer."""
    answer = pbs_as_root(pbs, "qstat", "-x", "-f", "-F", "json", job_id)
    jobs = json.loads(answer.stdout).get("Jobs", {}) if answer.returncode == 0 and answer.stdout.strip() else {}
    job = next(iter(jobs.values()), {})
    return job if job.get("job_state") == "F" else None


def log_of_part(course, name, number):
    """The log of part NUMBER of a chain submitted with -o logs/NAME.log: that file, then FILE.part2, FILE.part3, ...
    (scripts/tools/resubmit.py)."""
    return course / "logs" / (f"{name}.log" if number == 1 else f"{name}.log.part{number}")


def logs_of(course, name):
    """The chain's logs in order: FILE, then FILE.part2, FILE.part3, ... (scripts/tools/resubmit.py)."""
    first = course / "logs" / f"{name}.log"
    parts = sorted(course.glob(f"logs/{name}.log.part*"), key=lambda path: int(path.name.rsplit("part", 1)[1]))
    return [wait_for_file(path) or "" for path in [first, *parts]]


# What a job prints where PBS refuses the follow-up it submits (a host the server does not take jobs from): the
# command to type instead.
REFUSED = re.compile(r"^resubmit\.py: error: could not submit the follow-up: qsub: Bad UID for job execution; to "
                     r"continue by hand once this job has ended, from the course directory on the login node: "
                     r"(?P<command>qsub .*)$", re.M)


@dataclass
class Part:
    """One job of a walltime chain, as the test followed it."""
    job_id: str
    log: str
    exit_status: int | None  # the job's, from qstat -x
    queued_after: list  # the jobs of the chain's name queued, held or running once it had ended
    next_log_there: bool  # whether the next part's log was there once it had ended
    typed: str | None = None  # where its follow-up was refused: the command the test typed, as a user would


def follow_the_chain(pbs, course, name, first):
    """The parts of the chain NAME that starts with job FIRST, in order, each once it has ended. Where a part's
    follow-up was refused, types the command its log gives, as the user on the login node (the PBS server's host),
    from the course directory, as the log says, which continues the chain; a part's own follow-up goes on by itself.
    A hang guard, as in answers_of: it gives up when a part takes JOB_SECONDS to end."""
    parts, job_id = [], first
    while job_id:
        deadline = time.monotonic() + JOB_SECONDS
        while not (job := finished_job(pbs, job_id)):
            assert time.monotonic() < deadline, f"job {job_id}, part {len(parts) + 1} of the chain {name}, did " \
                                                f"not end within {JOB_SECONDS} s: {job_state(pbs, job_id)}"
            time.sleep(0.5)
        log = wait_for_file(log_of_part(course, name, len(parts) + 1)) or ""
        part = Part(job_id, log, job.get("Exit_status"), jobs_named(pbs, name),
                    log_of_part(course, name, len(parts) + 2).exists())
        parts.append(part)
        follow_up, refused = re.search(r"^== follow-up: job (\S+) continues ", log, re.M), REFUSED.search(log)
        job_id = follow_up[1] if follow_up else None
        if refused and not follow_up:
            part.typed = refused["command"]
            answer = pbs_as_user(pbs, f"cd {shlex.quote(str(course))} && {part.typed}")
            assert answer.returncode == 0, f"{part.typed}\n{answer.stderr}"
            job_id = answer.stdout.strip()
    return parts


WALLTIME_JOB = {  # 04_ddp.pbs, submitted as "walltime": the chain below
    "resources": ("select=1:ncpus=1:mem=2gb:ngpus=2", "walltime=00:02:00"),
    "variables": {"COURSE_ARGS": f"{LONG_RUN} --stop-margin 35 --fault stall --fault-step 3 --fault-seconds 30 "
                                 f"--save checkpoints/walltime.pt --run-name walltime", **ON_CPUS},
}


@pytest.fixture(scope="module")
def stopped_jobs(pbs, course, tmp_path_factory):
    """Two jobs at once, and the reference run meanwhile:

    - "walltime": 04_ddp.pbs with a walltime of 2 minutes, started on the second host (qrun -H), where this PBS
      refuses a job's own qsub (flatuid is off): the job's follow-up is refused, and the test types the command
      its log gives on the login node, as a user would. Rank 0 stalls 30 s after step 3, as a slow step would:
      two more such steps and the 35 s kept free (--stop-margin) cannot fit before the walltime, whatever the
      machine's speed, so the run stops after step 4 with a checkpoint. The follow-up lands wherever PBS puts it
      and finishes the run; on a loaded machine a follow-up may run out of walltime in its turn: it stops the same
      way, and its own follow-up is submitted (on the server's host) or refused and typed (on the second host);
    - "qdel": 04_ddp.pbs, deleted with qdel once its first checkpoint is there (a checkpoint every step).
    """
    walltime = submit_to(pbs, NODE2, course, "walltime", WALLTIME_JOB["resources"], WALLTIME_JOB["variables"])
    deleted = submit(pbs, course, "qdel", ("select=1:ncpus=1:mem=2gb:ngpus=2", "walltime=00:10:00"), {
        "COURSE_ARGS": f"{LONG_RUN} --checkpoint-every 1 --run-name qdel", **ON_CPUS})
    deadline = time.monotonic() + JOB_SECONDS
    folder = course / "checkpoints" / f"qdel-{deleted}"
    while not checkpoints_in(folder) and job_state(pbs, deleted) != "F" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert checkpoints_in(folder), f"the qdel job wrote no checkpoint: {job_state(pbs, deleted)}"
    assert pbs_as_root(pbs, "qdel", deleted).returncode == 0  # a step or two in, of 120
    reference = tmp_path_factory.mktemp("reference")
    with open(reference / "output.txt", "w") as output:  # a file, not a pipe: nothing blocks it while it runs
        run = subprocess.Popen([f"{pbs['PBS_JOB_VENV']}/bin/python", "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node=2", "scripts/step4_ddp.py", *LONG_RUN.split(), "--checkpoint-dir",
                                str(reference / "checkpoints"), "--results-dir", str(reference), "--save",
                                str(reference / "reference.pt")],
                               cwd=course, env={**clean_environment(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                               stdout=output, stderr=subprocess.STDOUT)
    try:
        chain = follow_the_chain(pbs, course, "walltime", walltime)
        assert run.wait(timeout=JOB_SECONDS) == 0, (reference / "output.txt").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    while job_state(pbs, deleted) != "F" and time.monotonic() < deadline:
        time.sleep(1)
    return {"walltime": walltime, "chain": chain, "qdel": deleted,
            "reference": torch.load(reference / "reference.pt")}


def expected_by_hand(course, name, part, job):
    """The qsub command that continues part PART of the chain NAME (whose first job is JOB) by hand: the job file
    and its request as the test submitted it (PBS adds the queue and place=free), the checkpoint folder, the part,
    and the next part's log."""
    variables = {**WALLTIME_JOB["variables"], "COURSE_CHECKPOINT_DIR": f"checkpoints/{name}-{job}",
                 "COURSE_JOB_PART": str(part + 1)}
    select, walltime = WALLTIME_JOB["resources"]
    return shlex.join(["qsub", "-q", "workq", "-l", select, "-l", "place=free", "-l", walltime, "-N", name, "-j",
                       "oe", "-o", f"{HEAD}:{log_of_part(course, name, part + 1)}", "-v",
                       ",".join(f"{key}={value}" for key, value in variables.items()), "job_scripts/04_ddp.pbs"])


def check_refused(part, number, course, first_job):
    """Part NUMBER ran on the second host, so its follow-up was refused: one line says so with the command to type
    on the login node; the job fails (resubmit.py's status), and nothing was submitted."""
    lines = [line for line in part.log.splitlines() if line.startswith("resubmit.py:")]
    assert len(lines) == 1 and REFUSED.fullmatch(lines[0]), part.log
    assert REFUSED.search(part.log)["command"] == expected_by_hand(course, "walltime", number, first_job), part.log
    assert "== follow-up" not in part.log and "not continued" not in part.log, part.log
    assert part.exit_status == 1, f"exit status {part.exit_status}\n{part.log}"
    assert part.queued_after == [] and not part.next_log_there, part.queued_after  # nothing was submitted


def test_a_follow_up_refused_on_the_second_host_names_the_command_to_type_on_the_login_node(stopped_jobs, course):
    """The first part of the chain ran on the second host, where this PBS, like OpenPBS by default (flatuid off),
    refuses a job's own qsub: its log has the one line that says so and gives the command; typed as it is on the
    login node, from the course directory, it submitted the next part, which resumed from the checkpoint."""
    first, second = stopped_jobs["chain"][:2]
    assert re.search(rf"^== job {re.escape(first.job_id)} on {NODE2}, ", first.log, re.M), first.log
    check_refused(first, 1, course, stopped_jobs["walltime"])
    assert first.typed and second.job_id != first.job_id
    folder = f"checkpoints/walltime-{stopped_jobs['walltime']}"
    assert re.search(rf"^resumed from {re.escape(folder)}/checkpoint-00000004\.pt: epoch ", second.log, re.M), (
        second.log)


def test_a_job_stops_before_its_walltime_submits_its_follow_up_and_the_chain_ends_with_the_same_weights(
        stopped_jobs, course):
    """Every part of the chain but the last stops before its walltime with a checkpoint and is followed by the next
    part, which resumes from that checkpoint: the first part after step 4 (its stall), a follow-up wherever the
    machine's speed took it (on a loaded machine a follow-up may not finish the run within its walltime). A part
    on the server's host submits its follow-up itself; one on the second host (the first part, and any other PBS
    put there) is refused, and its follow-up is the command its log gives, typed on the login node."""
    chain = stopped_jobs["chain"]
    assert len(chain) >= 2, "\n=====\n".join(part.log for part in chain)
    folder = f"checkpoints/walltime-{stopped_jobs['walltime']}"
    assert "== time limit: walltime 00:02:00 (qstat -f)" in chain[0].log, chain[0].log
    stopped_at = None  # the step the part before stopped at
    for number, part in enumerate(chain, 1):
        log = part.log
        assert "exceeded limit" not in log and "== exit status 0 after" in log, log  # PBS killed no part
        if stopped_at is not None:
            assert f"resumed from {folder}/checkpoint-{stopped_at:08d}.pt: epoch " in log, log
        if number == len(chain):  # it finished: the chain ends
            assert "stopped at step" not in log and "== follow-up" not in log and "resubmit.py" not in log, log
            assert part.exit_status == 0 and part.queued_after == [], log
            break
        stop = re.search(r"^stopped at step (\d+) \(--stop-after 0:02:00 would run out during the next steps\), "
                         rf"checkpoint written, resumable: the same command with --resume continues from "
                         rf"{re.escape(folder)}/checkpoint-(\d+)\.pt$", log, re.M)
        assert stop and int(stop[2]) == int(stop[1]), log
        if number == 1:
            assert stop[1] == "4", log  # the stall after step 3 makes the next two steps too long to fit
        stopped_at = int(stop[1])
        host = re.search(rf"^== job {re.escape(part.job_id)} on (\S+), ", log, re.M)
        assert host and host[1] in (HEAD, NODE2), log
        if host[1] == NODE2:
            check_refused(part, number, course, stopped_jobs["walltime"])
        else:
            assert re.search(rf"^== follow-up: job {re.escape(chain[number].job_id)} continues from "
                             rf"{re.escape(folder)} once job {re.escape(part.job_id)} has ended \(qsub -W "
                             rf"depend=afterany:{re.escape(part.job_id)}\)$", log, re.M), log
            assert "resubmit.py" not in log and part.exit_status == 0 and not part.typed, log
    final = torch.load(course / "checkpoints" / "walltime.pt")
    assert final.keys() == stopped_jobs["reference"].keys()
    assert all(torch.equal(final[key], stopped_jobs["reference"][key]) for key in final)


def test_qdel_during_training_leaves_a_resumable_checkpoint_of_the_step_it_stopped_at(stopped_jobs, pbs, course):
    log = logs_of(course, "qdel")[0]
    folder = course / "checkpoints" / f"qdel-{stopped_jobs['qdel']}"
    stop = re.search(r"^stopped at step (\d+) \(SIGTERM\), checkpoint written, resumable", log, re.M)
    assert stop, log
    step = int(stop[1])
    assert (folder / "STOPPED").read_text() == f"SIGTERM {step}\n"
    assert checkpoints_in(folder)[-1].name == f"checkpoint-{step:08d}.pt"
    assert f"== stopped at step {step} (SIGTERM), not continued" in log and "== follow-up" not in log, log
    assert not jobs_named(pbs, "qdel")  # qdel means stop: nothing was submitted
    resumed = subprocess.run([f"{pbs['PBS_JOB_VENV']}/bin/python", "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=2", "scripts/step4_ddp.py", *LONG_RUN.split(), "--resume",
                              "--checkpoint-dir", str(folder), "--run-name", "qdel", "--save", "checkpoints/qdel.pt"],
                             cwd=course, env={**clean_environment(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                             capture_output=True, text=True, timeout=JOB_SECONDS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint-{step:08d}.pt: epoch " in resumed.stdout
    final = torch.load(course / "checkpoints" / "qdel.pt")
    assert all(torch.equal(final[key], stopped_jobs["reference"][key]) for key in final)
