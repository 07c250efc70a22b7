"""The PBS job scripts, run as PBS would run them, on this machine.

There is no PBS server here. A PBS job script is a bash script whose #PBS lines are
comments, so each test runs it under bash with the environment PBS would set:
PBS_O_WORKDIR (the course directory), PBS_NODEFILE, PBS_JOBID, NCPUS, and no GPU, so
the CPU and gloo path is taken. The 2-node job gets a node file naming two loopback
hosts and a stand-in for pbsdsh (tests/cluster_stand_ins/pbsdsh) first on PATH: its
two torchruns meet over c10d on loopback and train with world size 4.
"""
import re
import subprocess

import pytest

from cluster_helpers import (
    JOB_SCRIPTS, REPO, SHORT_RUN, STAND_INS, clean_environment, job_id_with_free_port, pbs_environment,
    read_record, run_job, shellcheck,
)

STEPS = ["01_baseline", "02_allreduce", "03_data_parallel", "04_ddp", "04_ddp_2nodes"]
PBS_JOBS = sorted(JOB_SCRIPTS.glob("*.pbs"))
SLURM_JOBS = sorted(JOB_SCRIPTS.glob("*.sbatch"))
OTHER_JOBS = ["jupyter"]  # JupyterLab on a node: tests/test_jupyter_job.py
SHELL_FILES = sorted(JOB_SCRIPTS.iterdir()) + [STAND_INS / "pbsdsh", REPO / ".ci" / "start_slurm.sh"]


def names(paths):
    return [path.name for path in paths]


def test_every_step_has_a_pbs_and_a_slurm_job():
    assert [path.stem for path in PBS_JOBS] == sorted(STEPS + OTHER_JOBS)
    assert [path.stem for path in SLURM_JOBS] == sorted(STEPS + OTHER_JOBS)


@pytest.mark.parametrize("path", SHELL_FILES, ids=names(SHELL_FILES))
def test_shellcheck(path):
    if not shellcheck():
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/start_slurm.sh does it)")
    # -x follows `source job_scripts/common.sh`, which is relative to the course directory.
    result = subprocess.run([shellcheck(), "-x", str(path.relative_to(REPO))], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


PATH_IN_SCRIPT = re.compile(r"(?<![\w./$-])((?:job_scripts|scripts|tests|data)/[\w./-]*\w)")


@pytest.mark.parametrize("path", PBS_JOBS + SLURM_JOBS + [JOB_SCRIPTS / "node_launch.sh", JOB_SCRIPTS / "common.sh"],
                         ids=names(PBS_JOBS + SLURM_JOBS) + ["node_launch.sh", "common.sh"])
def test_every_path_a_job_names_exists(path):
    named = set(PATH_IN_SCRIPT.findall(path.read_text()))
    assert named, "expected the job to name the files it runs"
    missing = sorted(name for name in named if not (REPO / name).exists())
    assert not missing, f"{path.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("path", PBS_JOBS, ids=names(PBS_JOBS))
def test_pbs_resource_lines(path):
    text = path.read_text()
    select = re.search(r"^#PBS -l select=(\S+)", text, re.M).group(1)
    assert re.search(r"ncpus=\d+", select) and re.search(r"ngpus=\d+", select) and "gpu_model=" in select
    assert re.search(r"^#PBS -l walltime=\d+:\d\d:\d\d$", text, re.M)
    assert re.search(r"^#PBS -q \S+$", text, re.M)
    assert 'cd "${PBS_O_WORKDIR' in text
    if path.stem == "01_baseline":
        assert select.startswith("1:ncpus=8:mem=16gb:ngpus=1:")
    if path.stem == "04_ddp_2nodes":
        assert select.startswith("2:") and "mpiprocs=1" in select and "#PBS -l place=scatter" in text


# ---------------------------------------------------------------- running the PBS jobs

def run_pbs_job(step, tmp_path, hosts=("localhost",), ncpus=2, extra_args="", launch_args=""):
    job_id = job_id_with_free_port(step.replace("_", "")[:8])
    args = f"{SHORT_RUN} --results-dir {tmp_path} --run-name {step} {extra_args}".strip()
    env = pbs_environment(tmp_path, list(hosts), job_id, ncpus, args)
    env["COURSE_LAUNCH_ARGS"] = launch_args
    # PBS starts a job in the home directory; the job must cd to PBS_O_WORKDIR itself.
    result = run_job(JOB_SCRIPTS / f"{step}.pbs", env, cwd=tmp_path)
    return result, tmp_path / f"{step}.json"


SINGLE_NODE_JOBS = [  # job, script, world size with NCPUS=2 and no GPU
    ("01_baseline", "train_single", 1),
    ("02_allreduce", "train_allreduce", 2),
    ("03_data_parallel", "train_dp", 1),
    ("04_ddp", "train_ddp", 2),
]


@pytest.mark.parametrize("step, script, world_size", SINGLE_NODE_JOBS, ids=[job[0] for job in SINGLE_NODE_JOBS])
def test_single_node_pbs_job_trains(tmp_path, step, script, world_size):
    result, record_path = run_pbs_job(step, tmp_path)
    log = result.stdout
    assert result.returncode == 0, log
    assert "== job " in log and "== torch " in log and "== python: " in log and "== GPUs: " in log
    assert "== exit status 0" in log
    record = read_record(record_path)
    assert (record["script"], record["world_size"], record["device"]) == (script, world_size, "cpu")
    assert record["dataset"] == "mnist5k" and len(record["per_epoch"]) == 1
    if world_size > 1:
        assert f"pre-flight all_reduce ok: {world_size} rank(s)" in log


@pytest.fixture(scope="module")
def two_node_and_one_node_runs(tmp_path_factory):
    """The real 2-node job (2 loopback hosts x 2 processes) and 04_ddp.pbs with 4 processes.

    Both also pass launcher options through COURSE_LAUNCH_ARGS: the 2-node job's cross pbsdsh.
    """
    two = tmp_path_factory.mktemp("two_nodes")
    one = tmp_path_factory.mktemp("one_node")
    return run_pbs_job("04_ddp_2nodes", two, hosts=("localhost", "127.0.0.1"), ncpus=2, launch_args="--join-timeout 120"), \
        run_pbs_job("04_ddp", one, ncpus=2, launch_args="--nproc-per-node 4")


def test_two_node_pbs_job_rendezvous_and_trains(two_node_and_one_node_runs):
    (result, record_path), _ = two_node_and_one_node_runs
    log = result.stdout
    assert result.returncode == 0, log
    assert "== pbsdsh: node_launch.sh on 2 node(s): localhost 127.0.0.1" in log
    for node in (0, 1):
        assert f"node {node} of 2 (localhost, 127.0.0.1)" in log  # one launcher per node
        assert f"== node {node} (" in log and re.search(rf"== node {node} \(\S+\): exit status 0", log)
    assert "pre-flight all_reduce ok: 4 rank(s)" in log
    assert log.count("join_timeout=120 scripts/train_ddp.py") == 2  # COURSE_LAUNCH_ARGS reached both nodes
    assert read_record(record_path)["world_size"] == 4
    assert not list(REPO.glob(".pbs_job.*")), "the job should remove its shared job folder"


def test_two_nodes_match_one_node_with_four_processes(two_node_and_one_node_runs):
    (two_result, two_path), (one_result, one_path) = two_node_and_one_node_runs
    assert two_result.returncode == 0, two_result.stdout
    assert one_result.returncode == 0, one_result.stdout
    two, one = read_record(two_path), read_record(one_path)
    assert two["world_size"] == one["world_size"] == 4
    assert two["global_batch_size"] == one["global_batch_size"]
    # The same ranks see the same shards with the same seeds; only where they run differs.
    assert two["final_test_loss"] == pytest.approx(one["final_test_loss"], rel=1e-4)
    assert two["final_test_accuracy"] == pytest.approx(one["final_test_accuracy"], abs=0.002)
    assert two["per_epoch"][0]["train_loss"] == pytest.approx(one["per_epoch"][0]["train_loss"], rel=1e-4)


# ---------------------------------------------------------------- failures reach the job's exit status

def test_a_failing_training_fails_the_job(tmp_path):
    result, _ = run_pbs_job("01_baseline", tmp_path, extra_args="--epochs 0")
    assert result.returncode != 0, result.stdout
    assert re.search(r"== exit status [1-9]", result.stdout)


def test_a_failing_node_fails_the_two_node_job(tmp_path):
    # pbsdsh exits 0 whatever its tasks do; the job reads each node's status instead.
    result, _ = run_pbs_job("04_ddp_2nodes", tmp_path, hosts=("localhost", "127.0.0.1"), extra_args="--epochs 0")
    assert result.returncode != 0, result.stdout
    assert "training failed on at least one node" in result.stdout
    assert not list(REPO.glob(".pbs_job.*"))


def test_outside_a_job_the_script_says_so(tmp_path):
    result = run_job(JOB_SCRIPTS / "04_ddp.pbs", clean_environment(), cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    assert "PBS_O_WORKDIR: is not set: submit this with qsub" in result.stdout


# ---------------------------------------------------------------- the pbsdsh stand-in itself

def test_pbsdsh_stand_in_runs_once_per_node_like_pbsdsh(tmp_path):
    env = pbs_environment(tmp_path, ["localhost", "127.0.0.1"], "1.stand-in", 2, "")
    env["HOME"] = str(tmp_path)
    env["VIRTUAL_ENV"] = "/set/by/the/job/script"
    task = 'echo "node=$PBS_NODENUM pwd=$PWD venv=${VIRTUAL_ENV:-none}"; exit $((PBS_NODENUM * 3))'
    result = subprocess.run([str(STAND_INS / "pbsdsh"), "--", "bash", "-c", task], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0  # as pbsdsh: a task's failure is not its exit status
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("node="))
    assert lines == [f"node=0 pwd={tmp_path} venv=none", f"node=1 pwd={tmp_path} venv=none"]
    assert "task 1 exit status 3" in result.stdout
