"""The sbatch job scripts, submitted to a real Slurm.

.ci/start_slurm.sh installs Debian's slurm-wlm and munge and starts a Slurm whose
partition has two nodes, both this machine (each its own slurmd), so even the 2-node
job runs for real: srun starts scripts/tools/launch.py on each node, and the two torchruns
meet over c10d. On the command line, sbatch overrides the #SBATCH lines this machine
cannot satisfy (partition, CPUs, memory, time), as a user at another site would, never
the GPU request: each node has 4 GPUs that do not exist (gres.conf), the jobs are granted
theirs, and they run on CPUs because the tests set COURSE_CPU_FALLBACK=yes, as a site
without GPUs would in site.sh (the "gpus_unseen" job shows the stop without it).
Skipped only where Slurm is not installed.
"""
import re
import shutil
import socket
import subprocess
import time

import pytest

from cluster_helpers import BATCH_TIMEOUT, JOB_SCRIPTS, REPO, SHORT_RUN, clean_environment, read_record
from data_makers import write_image_folder, write_resnet18_weights
from helpers import assert_same_weights, run_torchrun, saved_weights
from kit import schedulers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BATCH_TIMEOUT), pytest.mark.skipif(
    shutil.which("sbatch") is None,
    reason="Slurm is not installed (no sbatch on PATH); `sudo bash .ci/start_slurm.sh` installs and starts one",
)]

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}
WAIT_SECONDS = 600


def on_cpus():
    """The environment a job is submitted with: this Slurm's GPUs do not exist, and the site allows CPUs instead."""
    return {**clean_environment(), "COURSE_CPU_FALLBACK": "yes"}


def slurm(*command, timeout=30):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def default_partition():
    """The default partition (sinfo marks it with '*') and the CPUs of its smallest node."""
    rows = [line.split() for line in slurm("sinfo", "-h", "-o", "%P %c").stdout.splitlines()]
    for name, cpus in rows:
        if name.endswith("*"):
            return name.rstrip("*"), int(cpus.rstrip("+"))
    raise AssertionError(f"no default partition in sinfo: {rows}")


def job_state(job_id):
    text = slurm("scontrol", "show", "job", "-o", job_id).stdout
    state = re.search(r"JobState=(\S+)", text)
    exit_code = re.search(r"ExitCode=(\S+)", text)
    return (state.group(1) if state else "UNKNOWN"), (exit_code.group(1) if exit_code else "?")


@pytest.fixture(scope="module")
def submitted(tmp_path_factory):
    """Submit every sbatch job (plus one that must fail) at once; wait until all are done."""
    if "UP" not in slurm("scontrol", "ping").stdout:
        pytest.fail("Slurm is installed but its controller does not answer; start it: sudo bash .ci/start_slurm.sh")
    partition, node_cpus = default_partition()
    cpus = min(2, node_cpus)
    # This machine's answers to the #SBATCH lines written for a GPU cluster: everything but the GPUs.
    overrides = [f"--partition={partition}", "--mem=0", f"--cpus-per-task={cpus}", "--time=10"]
    out = tmp_path_factory.mktemp("slurm")
    write_image_folder(out / "finetune" / "imagefolder")
    write_resnet18_weights(out / "finetune" / "resnet18-weights.pt")
    jobs = {}
    # Every training job; the JupyterLab job serves until cancelled (tests/test_jupyter_job.py runs it); the
    # doctor's jobs are in DOCTOR_JOBS.
    for step in [path.stem for path in sorted(JOB_SCRIPTS.glob("*.sbatch"))
                 if path.stem not in ("jupyter", "doctor")] + ["failing", "gpus_unseen"]:
        # gpus_unseen: a 2-node job whose srun lets each node's launcher finish (a training job's --kill-on-bad-exit
        # would end one node's at the other's first failure, before it says its line).
        script = {"failing": "01_baseline", "gpus_unseen": "doctor"}.get(step, step)
        env = on_cpus()
        if step == "gpus_unseen":  # site.sh's default: GPUs granted that torch cannot see stop the job
            env["COURSE_CPU_FALLBACK"] = "no"
        env["COURSE_ARGS"] = (f"{SHORT_RUN} --results-dir {out} --run-name {step} " +
                              DATA.get(step, "").format(out=out) + (" --epochs 0" if step == "failing" else ""))
        env["COURSE_CHECKPOINT_DIR"] = str(out / "checkpoints" / step)
        result = subprocess.run(
            ["sbatch", "--parsable", *overrides, f"--job-name=test-{step}", f"--output={out}/{step}-%j.out",
             f"job_scripts/{script}.sbatch"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, f"sbatch {script}.sbatch: {result.stderr}"
        jobs[step] = result.stdout.strip().split(";")[0]
    for name, (sbatch_options, variables, _) in DOCTOR_JOBS.items():
        env = {**on_cpus(), **variables}
        result = subprocess.run(
            ["sbatch", "--parsable", *overrides, *sbatch_options, f"--job-name=test-{name}",
             f"--output={out}/{name}-%j.out", "job_scripts/doctor.sbatch"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"sbatch doctor.sbatch: {result.stderr}"
        jobs[name] = result.stdout.strip().split(";")[0]

    # A hang guard, not a time limit: the jobs share two nodes and run a few at a time, and a loaded machine
    # stretches each of them, so the wait fails only when no job has changed state for WAIT_SECONDS.
    states, last_change = {}, time.monotonic()
    while True:
        # A finished job keeps the state it ended in: Slurm forgets a job MinJobAge (600 s, .ci/start_slurm.sh) after
        # its end, and a batch stretched by load outlasts that ("Invalid job id" for its first jobs).
        now = {step: states[step] if states.get(step, ("",))[0] in DONE else job_state(job_id)
               for step, job_id in jobs.items()}
        if all(state in DONE for state, _ in now.values()):
            states = now
            break
        if now != states:
            states, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > WAIT_SECONDS:
            slurm("scancel", *jobs.values())
            pytest.fail(f"no Slurm job changed state for {WAIT_SECONDS} s: {states}")
        time.sleep(1)
    logs = {step: "\n".join(path.read_text() for path in out.glob(f"{step}-*.out")) for step in jobs}
    return {"out": out, "cpus": cpus, "states": states, "logs": logs, "jobs": jobs, "overrides": overrides}


# Small offline data for the source tutorials' jobs (their own flags name the real data sets).
SYNTHETIC_CIFAR = "--dataset synthetic-cifar10 --batch-size 16"
DATA = {
    "06_cifar10_baseline": SYNTHETIC_CIFAR, "06_cifar10_ddp": SYNTHETIC_CIFAR, "06_cifar10_ddp_2nodes": SYNTHETIC_CIFAR,
    "06_model_parallel": SYNTHETIC_CIFAR,
    "06_finetune_2nodes": "--data-dir {out}/finetune/imagefolder --weights {out}/finetune/resnet18-weights.pt "
                          "--batch-size 2",
}

EXPECTED = {  # step: (script, world size: the processes of the GPUs each job asks for, here on CPUs)
    "01_baseline": ("step1_baseline", 1),
    "02_allreduce": ("step2_allreduce", 2),
    "03_data_parallel": ("step3_data_parallel", 1),  # one process, DataParallel over the node's devices
    "04_ddp": ("step4_ddp", 2),
    "04_ddp_2nodes": ("step4_ddp", 4),
    "06_cifar10_baseline": ("step1_baseline", 1),
    "06_cifar10_ddp": ("step4_ddp", 2),
    "06_cifar10_ddp_2nodes": ("step4_ddp", 4),
    "06_finetune_2nodes": ("step6_finetune", 4),
    "06_model_parallel": ("step6_model_parallel", 1),  # one replica over the 2 GPUs
}


def granted_on_cpus(gpus):
    return (f"launch.py: warning: the job was granted {gpus} GPU(s) on {{host}} (SLURM_GPUS_ON_NODE={gpus}) but torch "
            "sees none: running on CPUs, as COURSE_CPU_FALLBACK=yes in job_scripts/site.sh allows")


# The doctor's jobs: sbatch options beyond the overrides, the job's variables, and the diagnoses expected (regular
# expressions, in order). This Slurm's two nodes are one machine (.ci/start_slurm.sh): the doctor says so.
HOST = socket.gethostname()
DOCTOR_JOBS = {
    "doctor": ([], {}, [rf"a host listed twice: {HOST} runs the ranks of 2 torchruns "
                        r"\(node ranks 0, 1\): two launchers on one host"]),
    # One node, launched by default: a rank per GPU granted, on this machine's 2 cores. Notes, and no problem.
    "doctor_one_node": (["--nodes=1"], {}, []),
}


@pytest.mark.parametrize("name", sorted(DOCTOR_JOBS))
def test_the_doctor_reports_the_placement_slurm_gave(submitted, name):
    _, _, expected = DOCTOR_JOBS[name]
    state, exit_code = submitted["states"][name]
    log = submitted["logs"][name]
    verdict = ("FAILED", "1:0") if expected else ("COMPLETED", "0:0")
    assert (state, exit_code) == verdict, f"{state} {exit_code}\n{log}"
    found = re.findall(r"^diagnosis: (.*)$", log, re.M)
    assert len(found) == len(expected) and all(re.match(p, line) for p, line in zip(expected, found)), (found, log)
    hosts = re.search(r"^job's hosts: SLURM_JOB_NODELIST: (.*)$", log, re.M)
    nodes = 1 if name == "doctor_one_node" else 2
    assert hosts and len(hosts[1].split(", ")) == nodes, log  # the job's Slurm nodes, as scontrol names them
    assert len(re.findall(rf"^\d+ +{re.escape(HOST)} +", log, re.M)) >= nodes, log  # one table row per rank at least
    assert "all_reduce with gloo: the sum of ones is" in log and "the world size" in log, log
    assert re.search(r"^note: GPUs granted but unseen: \S+ was granted 2 GPU\(s\) \(SLURM_GPUS_ON_NODE=2\) but "
                     r"torch sees none: running on CPUs \(COURSE_CPU_FALLBACK=yes\)$", log, re.M), log
    if not expected:  # the default layout passes: its few cores per rank are a note
        assert re.search(r"^note: one CPU core per rank: .* runs 2 rank\(s\) on ", log, re.M), log
        assert re.search(r"^doctor: no problem found \(\d notes\)$", log, re.M), log


@pytest.mark.parametrize("step", sorted(EXPECTED))
def test_sbatch_job_completes_and_writes_its_record(submitted, step):
    state, exit_code = submitted["states"][step]
    log = submitted["logs"][step]
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"job {submitted['jobs'][step]}: {state} {exit_code}\n{log}"
    assert "== job " in log and "== torch " in log and "== exit status 0" in log
    script, world_size = EXPECTED[step]
    record = read_record(submitted["out"] / f"{step}.json")
    assert (record["script"], record["world_size"]) == (script, world_size)
    gpus = 1 if "baseline" in step else 2
    nodes = 2 if step.endswith("_2nodes") else 1
    found = re.findall(r"^launch.py: warning: the job was granted .*$", log, re.M)
    # One line from each node's launcher: the host is Slurm's node name (both are this machine here).
    assert len(found) == nodes and all(re.fullmatch(re.escape(granted_on_cpus(gpus)).replace(
        re.escape("{host}"), r"\S+"), line) for line in found), log
    if step.startswith("06_"):
        assert record["model"] == "resnet18" and "total " in log


def test_two_node_sbatch_job_starts_one_launcher_per_node(submitted):
    log = submitted["logs"]["04_ddp_2nodes"]
    assert re.search(r"this node +0 of 2", log) and re.search(r"this node +1 of 2", log), log
    assert re.search(r"rendezvous +c10d at ", log), log
    assert "pre-flight all_reduce ok: 4 rank(s)" in log


def test_a_failing_sbatch_job_fails(submitted):
    state, exit_code = submitted["states"]["failing"]
    assert state == "FAILED" and exit_code != "0:0", submitted["logs"]["failing"]


def test_gpus_granted_that_torch_cannot_see_stop_the_job_on_every_node(submitted):
    state, exit_code = submitted["states"]["gpus_unseen"]
    log = submitted["logs"]["gpus_unseen"]
    assert state == "FAILED" and exit_code != "0:0", log
    stops = re.findall(r"^launch.py: error: the job was granted 2 GPU\(s\) on \S+ \(SLURM_GPUS_ON_NODE=2\) but torch "
                       r"sees none: .* A site without GPUs: COURSE_CPU_FALLBACK=yes in job_scripts/site.sh, or submit "
                       r"without the GPU request .*$", log, re.M)
    assert len(stops) == 2, log  # one line from each node, and nothing trained
    assert "torch.distributed.run" not in log and "pre-flight" not in log, log


def test_a_requeued_job_resumes_from_its_checkpoint(submitted):
    """scontrol requeue kills a running job and queues it again under the same id: it resumes."""
    out = submitted["out"]
    env = on_cpus()
    # Rank 0 stalls after step 2 (its checkpoint written), so the job is surely running then.
    env["COURSE_ARGS"] = (f"--epochs 1 --max-steps 4 --checkpoint-every 1 --fault stall --fault-step 2 "
                          f"--fault-seconds 600 --results-dir {out} --run-name requeued")
    env["COURSE_CHECKPOINT_DIR"] = str(out / "checkpoints" / "requeued")
    result = subprocess.run(["sbatch", "--parsable", *submitted["overrides"], "--job-name=test-requeued",
                             f"--output={out}/requeued.out", "job_scripts/04_ddp.sbatch"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    try:
        step_2 = out / "checkpoints" / "requeued" / "checkpoint-00000002.pt"
        deadline = time.monotonic() + WAIT_SECONDS
        while not step_2.exists() and job_state(job_id)[0] not in DONE and time.monotonic() < deadline:
            time.sleep(0.2)
        assert step_2.exists(), f"no checkpoint after step 2: {job_state(job_id)}"
        requeue = slurm("scontrol", "requeue", job_id)
        assert requeue.returncode == 0, requeue.stderr
        while job_state(job_id)[0] not in DONE and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        slurm("scancel", job_id)
    log = (out / "requeued.out").read_text()
    assert job_state(job_id) == ("COMPLETED", "0:0"), log
    assert log.count("== job ") == 2, log  # --open-mode=append: both runs in one log
    assert "resumed from " in log and "checkpoint-00000002.pt: epoch 1, 2 of" in log, log
    assert read_record(out / "requeued.json")["resumed_at_step"] == 2


def test_squeue_tells_a_checkpoint_folders_lock_whether_its_job_has_ended():
    """A lock left on a checkpoint folder by a job that died is taken over once squeue says the job is over
    (machinery/folder_lock.py): held while the job is queued, at once after scancel."""
    result = slurm("sbatch", "--parsable", "--hold", "--job-name=test-lock", "--output=/dev/null", "--wrap=true")
    assert result.returncode == 0, result.stderr
    job = f"Slurm {result.stdout.strip().split(';')[0]}"
    try:
        assert schedulers.job_ended(job) is False
    finally:
        slurm("scancel", job.split()[1])
    deadline = time.monotonic() + 60
    while not schedulers.job_ended(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert schedulers.job_ended(job) is True
    assert schedulers.job_ended("Slurm 999999999") is True  # long gone: "Invalid job id"


# ---------------------------------------------------------------- the time limit: warned, stopped, requeued

def test_a_job_warned_before_its_time_limit_stops_requeues_itself_and_ends_with_the_same_weights(tmp_path):
    """--time=3 with --signal=B:USR1@90: Slurm warns the job shell 90 s before the limit, or up to 60 s earlier
    (sbatch(1): "the signal may be sent up to 60 seconds earlier than specified"), so between 30 and 90 s after
    the start. Rank 0 stalls 90 s after step 3, as a slow step would, so the warning comes while the run trains
    whatever the machine's speed. The shell asks the run to stop (STOP in its checkpoint folder), the run stops
    after the next step with a checkpoint, and the job requeues itself; the requeued job resumes from that
    checkpoint (where its own warning comes before it is done, it stops and requeues again), until the run is
    complete: with the weights of a run never stopped, bit for bit."""
    if "UP" not in slurm("scontrol", "ping").stdout:
        pytest.fail("Slurm is installed but its controller does not answer; start it: sudo bash .ci/start_slurm.sh")
    partition, node_cpus = default_partition()
    train = "--epochs 2 --max-steps 10 --batch-size 32 --threads 1"
    env = on_cpus()
    env["COURSE_ARGS"] = (f"{train} --fault stall --fault-step 3 --fault-seconds 90 --results-dir {tmp_path} "
                          f"--run-name warned --save {tmp_path / 'warned.pt'}")
    folder = tmp_path / "checkpoints" / "warned"
    env["COURSE_CHECKPOINT_DIR"] = str(folder)
    result = subprocess.run(["sbatch", "--parsable", f"--partition={partition}", "--mem=0",
                             f"--cpus-per-task={min(2, node_cpus)}", "--time=3", "--signal=B:USR1@90",
                             "--job-name=test-warned", f"--output={tmp_path}/warned.out", "job_scripts/04_ddp.sbatch"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    reference = run_torchrun("step4_ddp.py", *train.split(), "--checkpoint-dir", tmp_path / "reference",
                             "--results-dir", tmp_path / "reference", "--save", tmp_path / "reference.pt", timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    try:
        deadline = time.monotonic() + 2 * WAIT_SECONDS
        while job_state(job_id)[0] not in DONE and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        slurm("scancel", job_id)
    log = (tmp_path / "warned.out").read_text()
    assert job_state(job_id) == ("COMPLETED", "0:0"), log
    assert "== time limit: SIGUSR1 ahead of it (--signal=B:USR1@...)" in log, log
    stops = [int(step) for step in re.findall(
        rf"^stopped at step (\d+) \(asked by {re.escape(str(folder / 'STOP'))}\), checkpoint written", log, re.M)]
    resumes = [int(step) for step in re.findall(
        rf"^resumed from {re.escape(str(folder))}/checkpoint-(\d+)\.pt: epoch", log, re.M)]
    assert stops and resumes == stops, log  # every requeued job resumed from the step the one before stopped at
    assert log.count("== SIGUSR1: the time limit is near; asking the run to stop") >= len(stops)
    assert log.count(f"== requeued: job {job_id} continues from {folder} (scontrol requeue)") == len(stops)
    assert log.count("== job ") == len(stops) + 1 and "saved the final weights" in log
    assert_same_weights(saved_weights(tmp_path, "warned"), saved_weights(tmp_path, "reference"))
