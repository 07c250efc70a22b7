"""scripts/tools/doctor.py, fed each misconfiguration it recognises, what it only notes, and a placement with none.

The diagnoses and notes are read first from reports built here (one per rank, as the ranks gather them): which
fail the job, which do not.

Made for real wherever this machine can: ranks pinned to one CPU core (the affinity a scheduler's cpuset
gives a job granted one core), a PBS node file that lists this host twice or lists another host (through
the course's launcher, as a job would run it), two torchruns started on one host. This machine has no GPU,
so the GPU cases run on a stand-in (tests/gpu_stand_in/sitecustomize.py): torch.cuda reports GPUs of the
compute capabilities a test asks for, with the real build's architecture list; launches, ranks and the
collectives (gloo) stay real. tests/test_pbs.py and tests/test_slurm.py run the doctor's jobs.

A check of one rank's GPUs runs the doctor under plain python, a world of one (as the doctor allows): torchrun
would add a process of its own and nothing a GPU's diagnosis reads.
"""
import os
import re
import socket
import subprocess

import pytest
import torch

from helpers import PYTHON, REPO, SCRIPTS, reserved_port, run_python, script_env
from kit import launch_checks
from tools import doctor

DOCTOR = SCRIPTS / "tools" / "doctor.py"
LAUNCHER = SCRIPTS / "tools" / "launch.py"
STAND_IN = REPO / "tests" / "gpu_stand_in"
HOST = socket.gethostname()
RUN_SECONDS = 300


def cores(count):
    """``count`` cores of this process's affinity, or a skip where the machine has fewer."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < count:
        pytest.skip(f"needs {count} CPU cores, this machine gives {len(mine)}")
    return set(mine[:count])


def doctor_env(gpus=None, **extra):
    """No scheduler; no GPU, or the stand-in's GPUs of the given compute capabilities ("9.0,7.0")."""
    env = script_env(**extra)
    scheduler = ["NCPUS", "NGPUS", "CUDA_VISIBLE_DEVICES", "COURSE_CPU_FALLBACK"]
    for name in [name for name in env if name.startswith(("PBS_", "SLURM_"))] + scheduler:
        env.pop(name, None)
    if gpus:
        env.update(COURSE_STAND_IN_GPUS=gpus, PYTHONPATH=os.pathsep.join([str(STAND_IN), env.get("PYTHONPATH", "")]))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)  # after the clean-up: a test may grant GPUs (CUDA_VISIBLE_DEVICES) or allow the CPU fall-back
    return env


def run(command, env, on_cores):
    """Run ``command`` (and every process it starts) on the CPU cores ``on_cores``; output and errors together."""
    return subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_SECONDS, preexec_fn=lambda: os.sched_setaffinity(0, on_cores))


def python_doctor(env, on_cores, *doctor_args):
    return run([PYTHON, str(DOCTOR), *doctor_args], env, on_cores)


def torchrun_doctor(nproc, env, on_cores, *doctor_args):
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(DOCTOR),
               *doctor_args]
    return run(command, env, on_cores)


def launched_doctor(nodefile_lines, tmp_path, env, on_cores, *launcher_args):
    """The doctor as a PBS job runs it: through scripts/tools/launch.py, with a node file of its own."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{line}\n" for line in nodefile_lines))
    env = {**env, "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "4242.pbs-test"}
    return run([PYTHON, str(LAUNCHER), "--max-restarts", "0", *launcher_args, str(DOCTOR)], env, on_cores)


def printed(output, prefix):
    return [line.removeprefix(prefix) for line in output.splitlines() if line.startswith(prefix)]


def diagnoses(output):
    return printed(output, "diagnosis: ")


def notes(output):
    return printed(output, "note: ")


def notes_counted(count):
    return f" ({count} note{'s' if count > 1 else ''})" if count else ""


def assert_diagnosed(done, *starts):
    """Exit status 1, and exactly one diagnosis line starting with each of ``starts``, in the doctor's order."""
    found = diagnoses(done.stdout)
    assert done.returncode != 0, done.stdout
    assert len(found) == len(starts) and all(line.startswith(start) for line, start in zip(found, starts)), (
        f"expected {starts}, got {found}\n{done.stdout}")
    verdict = rf"doctor: {len(starts)} problem\(s\) found{re.escape(notes_counted(len(notes(done.stdout))))}"
    assert re.search(rf"^{verdict}, exit status 1$", done.stdout, re.M), done.stdout
    return found


def assert_healthy(done, world_size, *note_starts):
    """Exit status 0, no diagnosis, and exactly one note starting with each of ``note_starts``."""
    assert done.returncode == 0, done.stdout
    assert not diagnoses(done.stdout), done.stdout
    found = notes(done.stdout)
    assert len(found) == len(note_starts) and all(map(str.startswith, found, note_starts)), (
        f"expected notes {note_starts}, got {found}\n{done.stdout}")
    assert f"all_reduce with gloo: the sum of ones is {world_size}, the world size" in done.stdout
    assert re.search(rf"^doctor: no problem found{re.escape(notes_counted(len(found)))}$", done.stdout, re.M), (
        done.stdout)
    return found


# ---------------------------------------------------------------- reports built here: what fails, what is noted

GPU_NAME = "Test GPU"


def report(rank, host="node-a", local_rank=None, gpus=0, cores=4, granted_gpus=None, granted_from="",
           cpu_fallback=False, node_rank=0, no_kernels=(), scheduler="slurm"):
    """One rank's report, in a job: ``gpus`` GPUs in its view (named by host and index, so two hosts' GPUs
    differ), ``cores`` CPU cores of its own, the GPUs the scheduler granted on its host."""
    local_rank = rank if local_rank is None else local_rank
    seen = [(GPU_NAME, "9.0", f"GPU-{host}-{index}") for index in range(gpus)]
    return doctor.Report(rank, local_rank, 2, node_rank, host, None, seen, list(no_kernels), list(range(cores)),
                         cores, "", scheduler, granted_gpus, granted_from, cpu_fallback, 1, "127.0.0.1 (lo)", None,
                         "localhost -> 127.0.0.1 via lo")


def labels(lines):
    return [line.split(":")[0] for line in lines]


@pytest.mark.parametrize("label, reports, listed", [
    ("two ranks on one GPU", [report(0, gpus=2, local_rank=0), report(1, gpus=2, local_rank=0, node_rank=1)],
     ["node-a"]),
    ("fewer GPUs than ranks", [report(0, gpus=1), report(1, gpus=1)], ["node-a"]),
    ("GPUs granted but unused", [report(0, gpus=2, granted_gpus=2, granted_from="SLURM_GPUS_ON_NODE=2")], ["node-a"]),
    ("GPUs granted but unseen", [report(0, granted_gpus=2, granted_from="SLURM_GPUS_ON_NODE=2")], ["node-a"]),
    ("a host listed twice", [report(0)], ["node-a", "node-a"]),
    ("a host not granted", [report(0)], ["node-b"]),
    ("a GPU without kernels", [report(0, gpus=1, no_kernels=[(0, GPU_NAME, "7.0")])], ["node-a"]),
])
def test_each_misconfiguration_is_a_diagnosis_and_fails_the_job(label, reports, listed):
    problems = doctor.diagnose(reports, "PBS_NODEFILE", listed)
    assert label in labels(problems), problems
    assert not doctor.notes(reports)
    assert doctor.verdict(problems, []) == f"doctor: {len(problems)} problem(s) found, exit status 1"


def test_one_cpu_core_per_rank_is_a_note_and_the_job_passes():
    reports = [report(0, cores=2), report(1, cores=2)]
    assert doctor.diagnose(reports, "PBS_NODEFILE", ["node-a"]) == []
    assert doctor.notes(reports) == [
        "one CPU core per rank: node-a runs 2 rank(s) on 2 CPU core(s), which leaves no core for loading data or the "
        "backend's threads; ask the job for more cores per node (PBS: ncpus in the select line; Slurm: "
        "--cpus-per-task) or start fewer processes (--nproc-per-node)"]
    assert doctor.verdict([], doctor.notes(reports)) == "doctor: no problem found (1 note)"


def test_the_verdict_counts_problems_and_notes():
    assert doctor.verdict([], []) == "doctor: no problem found"
    assert doctor.verdict([], ["a", "b"]) == "doctor: no problem found (2 notes)"
    assert doctor.verdict(["a", "b"], ["c"]) == "doctor: 2 problem(s) found (1 note), exit status 1"


def test_gpus_granted_but_unused_name_the_host_the_grant_and_the_fix():
    """node-a uses the 1 GPU it was granted; node-b trains on 1 of its 2 (--nproc-per-node 1 on a 2-GPU grant)."""
    reports = [report(0, gpus=1, granted_gpus=1, granted_from="SLURM_GPUS_ON_NODE=1"),
               report(1, "node-b", local_rank=0, gpus=2, granted_gpus=2, granted_from="SLURM_GPUS_ON_NODE=2",
                      node_rank=1)]
    assert doctor.diagnose(reports) == [
        "GPUs granted but unused: node-b was granted 2 GPU(s) (SLURM_GPUS_ON_NODE=2) and torch sees 2, but its ranks "
        "train on only 1 (rank 1); start one process per GPU (drop --nproc-per-node: the launcher then starts one per "
        "GPU granted) or ask the job for 1 GPU(s) per node"]


@pytest.mark.parametrize("why, reports", [
    ("one process per GPU granted", [report(0, gpus=2, granted_gpus=2), report(1, gpus=2, granted_gpus=2)]),
    ("nothing says what was granted", [report(0, gpus=2)]),
    ("no GPU granted", [report(0, gpus=2, granted_gpus=0)]),
    ("torch sees fewer than granted: unseen", [report(0, gpus=1, granted_gpus=2)]),
    ("torch sees none: unseen", [report(0, granted_gpus=2, cpu_fallback=True)]),
])
def test_gpus_granted_and_used_or_not_seen_are_not_unused(why, reports):
    assert "GPUs granted but unused" not in labels(doctor.diagnose(reports)), why


def test_gpus_granted_but_unseen_are_a_note_where_the_site_falls_back_to_cpus_and_fail_the_job_elsewhere():
    """The CI clusters' case: 2 GPUs granted per node (a count only), none that torch sees, one process."""
    granted = dict(granted_gpus=2, granted_from="ngpus=2 on node-a in the job's exec_vnode (qstat -f)")
    allowed, refused = [report(0, cpu_fallback=True, **granted)], [report(0, **granted)]
    what = ("GPUs granted but unseen: node-a was granted 2 GPU(s) (ngpus=2 on node-a in the job's exec_vnode "
            "(qstat -f)) but torch sees none: ")
    assert doctor.diagnose(allowed) == []
    assert doctor.notes(allowed) == [f"{what}running on CPUs (COURSE_CPU_FALLBACK=yes)"]
    assert doctor.notes(refused) == [] and doctor.diagnose(refused) == [
        f"{what}check the driver and the torch build (README: Which CUDA build); a site without GPUs allows CPUs "
        "instead: COURSE_CPU_FALLBACK=yes in job_scripts/site.sh"]


def test_gpus_granted_and_partly_seen_fail_the_job_even_where_the_site_falls_back_to_cpus():
    """As the launcher: a partial view stops the job; the fall-back is for a node that sees none."""
    reports = [report(0, gpus=1, granted_gpus=2, granted_from="SLURM_GPUS_ON_NODE=2", cpu_fallback=True)]
    assert doctor.notes(reports) == [] and doctor.diagnose(reports) == [
        "GPUs granted but unseen: node-a was granted 2 GPU(s) (SLURM_GPUS_ON_NODE=2) but torch sees 1: check "
        "`nvidia-smi` and CUDA_VISIBLE_DEVICES on that host"]


@pytest.mark.parametrize("scheduler", ["none", "slurm"])
def test_gpus_unseen_outside_a_scheduler_are_not_a_grant_the_launcher_checks(scheduler):
    """Nor a CUDA_VISIBLE_DEVICES in a job (it may come from the submitting shell): the launcher only warns."""
    reports = [report(0, granted_gpus=2, granted_from="CUDA_VISIBLE_DEVICES=0,1", scheduler=scheduler)]
    assert doctor.diagnose(reports) == [] and doctor.notes(reports) == []


@pytest.mark.parametrize("env, grant", [
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-a", "SLURM_GPUS_ON_NODE": "2"},
     ("slurm", 2, "SLURM_GPUS_ON_NODE=2")),
    ({"PBS_JOBID": "7.pbs", "NGPUS": "2", "CUDA_VISIBLE_DEVICES": "0"}, ("pbs", 1, "CUDA_VISIBLE_DEVICES=0")),
    ({"PBS_JOBID": "7.pbs", "NGPUS": "2"}, ("pbs", 2, "NGPUS=2")),
    ({}, ("none", None, "")),
])
def test_each_rank_reads_its_hosts_grant_as_the_launcher_does(env, grant):
    assert doctor.gpu_grant_here(env) == grant


# ---------------------------------------------------------------- placements the doctor accepts

@pytest.mark.slow
def test_the_launchers_layout_on_two_cores_passes_with_a_note_and_the_table_says_where_it_runs():
    """Two processes on a 2-core CPU machine, as launch.py and make run choose: slow, not wrong."""
    done = torchrun_doctor(2, doctor_env(), cores(2))
    found = assert_healthy(done, 2, "one CPU core per rank")
    assert found[0].startswith(f"one CPU core per rank: {HOST} runs 2 rank(s) on 2 CPU core(s), "), found
    assert f"doctor: 2 rank(s) on 1 node(s): {HOST} [0-1]" in done.stdout
    for rank in (0, 1):  # rank, host, node rank, local rank, no GPU, CUDA_VISIBLE_DEVICES='', 2 cores, 1 thread
        row = rf"^{rank} +{re.escape(HOST)} +0 +{rank} +none +'' +2 \(.+\) +1 +\S+ .* -> [\d.]+ via \S+$"
        assert re.search(row, done.stdout, re.M), done.stdout


@pytest.mark.slow
def test_a_gpu_of_a_supported_architecture_for_each_rank_is_healthy():
    done = python_doctor(doctor_env(gpus="9.0"), cores(2), "--backend", "gloo")
    assert_healthy(done, world_size=1)
    assert "cuda:0 Stand-in GPU 9.0 (9.0)" in done.stdout


# ---------------------------------------------------------------- each misconfiguration, made for real

@pytest.mark.slow
def test_gpus_granted_that_torch_cannot_see_are_a_note_where_the_site_falls_back_to_cpus():
    """The CI clusters' case: a Slurm job granted 2 GPUs on this host, which has none."""
    job = dict(SLURM_JOB_ID="42", SLURM_JOB_NODELIST=HOST, SLURM_GPUS_ON_NODE="2", COURSE_CPU_FALLBACK="yes")
    done = python_doctor(doctor_env(**job), cores(2))
    found = assert_healthy(done, 1, "GPUs granted but unseen")
    assert found[0] == (f"GPUs granted but unseen: {HOST} was granted 2 GPU(s) (SLURM_GPUS_ON_NODE=2) but torch "
                        "sees none: running on CPUs (COURSE_CPU_FALLBACK=yes)"), found


@pytest.mark.slow
def test_a_node_file_that_lists_this_host_twice_is_diagnosed(tmp_path):
    done = launched_doctor([HOST, HOST], tmp_path, doctor_env(), cores(2), "--nproc-per-node", "1")
    found = assert_diagnosed(done, "a host listed twice")
    assert found[0].startswith(f"a host listed twice: PBS_NODEFILE lists {HOST} 2 times: "), found
    assert "launch.py: PBS job 4242.pbs-test" in done.stdout  # the course's launcher started it, as a job does


@pytest.mark.slow
def test_ranks_on_a_host_the_job_was_not_granted_are_diagnosed(tmp_path):
    done = launched_doctor(["gpu-node-07"], tmp_path, doctor_env(), cores(2), "--nproc-per-node", "1")
    found = assert_diagnosed(done, "a host not granted")
    assert found[0].startswith(f"a host not granted: rank 0 on {HOST}, which is not among the job's hosts "
                               "(PBS_NODEFILE: gpu-node-07); "), found


@pytest.mark.slow
def test_two_torchruns_on_one_host_put_two_ranks_on_one_gpu():
    """Two launchers on one host (--nnodes=2, both here): each numbers its local ranks from 0, so both ranks
    would train on cuda:0."""
    env, on_cores = doctor_env(gpus="9.0"), cores(2)
    with reserved_port() as port:  # held until the rendezvous store binds it
        commands = [[PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf=is_host={is_host},join_timeout=120",
                     str(DOCTOR), "--backend", "gloo"] for is_host in (1, 0)]
        agents = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, preexec_fn=lambda: os.sched_setaffinity(0, on_cores))
                  for command in commands]
        outputs = [agent.communicate(timeout=RUN_SECONDS)[0] for agent in agents]
    assert all(agent.returncode != 0 for agent in agents), outputs
    done = subprocess.CompletedProcess(commands[0], 1, "".join(outputs))
    found = assert_diagnosed(done, "two ranks on one GPU", "a host listed twice")
    assert found[0].startswith(f"two ranks on one GPU: ranks 0-1 on {HOST} would all train on Stand-in GPU 9.0 "
                               f"GPU-stand-in-{HOST}-0 (cuda:0, cuda:0): "), found
    assert found[1].startswith(f"a host listed twice: {HOST} runs the ranks of 2 torchruns (node ranks 0, 1): "), found


@pytest.mark.slow
def test_a_node_with_fewer_gpus_than_ranks_is_diagnosed():
    done = torchrun_doctor(2, doctor_env(gpus="9.0"), cores(2), "--backend", "gloo")
    found = assert_diagnosed(done, "fewer GPUs than ranks")
    assert found[0].startswith(f"fewer GPUs than ranks: {HOST} runs 2 ranks but its processes see 1 GPU(s): no "
                               "cuda:LOCAL_RANK for rank 1 (local rank 1); start one process per GPU "
                               "(--nproc-per-node=1)"), found


@pytest.mark.slow
def test_one_process_on_two_gpus_granted_is_diagnosed():
    """--nproc-per-node 1 on a 2-GPU grant: one (stand-in) GPU trains, the other sits idle."""
    done = python_doctor(doctor_env(gpus="9.0,9.0", CUDA_VISIBLE_DEVICES="0,1"), cores(2), "--backend", "gloo")
    found = assert_diagnosed(done, "GPUs granted but unused")
    assert found[0].startswith(f"GPUs granted but unused: {HOST} was granted 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1) and "
                               "torch sees 2, but its ranks train on only 1 (rank 0); "), found


@pytest.mark.slow
def test_a_gpu_this_build_has_no_kernels_for_is_diagnosed_with_the_cuda_12_route():
    """GPU 0 is a Volta (7.0), GPU 1 a Hopper (9.0): only GPU 0 is named."""
    done = python_doctor(doctor_env(gpus="7.0,9.0"), cores(2), "--backend", "gloo")
    found = assert_diagnosed(done, "a GPU without kernels")
    assert found[0] == (f"a GPU without kernels: on {HOST}, GPU 0 (Stand-in GPU 7.0) has compute capability 7.0, "
                        f"and this torch {torch.__version__} (CUDA {torch.version.cuda}) has kernels only for "
                        f"{', '.join(torch.cuda.get_arch_list())}; {launch_checks.CUDA_12_ROUTE}"), found


# ---------------------------------------------------------------- the same architecture check before training

@pytest.mark.slow
def test_a_training_script_refuses_a_gpu_without_kernels_in_one_line_before_training():
    done = run_python("step1_baseline.py", "--device", "cuda", "--epochs", "1", "--max-steps", "1",
                      env=doctor_env(gpus="7.0"), timeout=RUN_SECONDS)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {launch_checks.architecture_problem(0, 'Stand-in GPU 7.0', '7.0')}"], done.stderr
    assert "--index-url https://download.pytorch.org/whl/cu126" in done.stderr
    assert "epoch" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("capability, arch_list, runs", [
    ((7, 0), ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], False),  # Volta on the CUDA 13 wheels
    ((7, 0), ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"], True),  # ... on the CUDA 12.6 ones
    ((8, 9), ["sm_80", "sm_86", "sm_90"], True),  # sm_86 machine code runs on 8.9: same major, newer minor
    ((8, 0), ["sm_86", "sm_90"], False),  # ... but not on an older minor
    ((9, 0), ["sm_75", "sm_80", "sm_86"], False),  # no machine code for 9.x and no PTX
    ((9, 0), ["sm_80", "compute_80"], True),  # PTX is compiled for newer GPUs when loaded
    ((9, 0), ["sm_90a"], True),  # an architecture-specific variant of 9.0
])
def test_the_architecture_rule(capability, arch_list, runs):
    assert launch_checks.has_kernels_for(capability, arch_list) is runs


def test_the_pinned_build_refuses_volta_and_runs_everything_newer():
    arch_list = torch.cuda.get_arch_list()
    if torch.version.cuda is None or not arch_list:
        pytest.skip("a torch build without CUDA: it has no architecture list")
    assert not launch_checks.has_kernels_for((7, 0), arch_list)
    assert all(launch_checks.has_kernels_for(capability, arch_list) for capability in [(7, 5), (8, 0), (8, 6), (9, 0)])
