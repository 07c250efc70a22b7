"""The job scripts as files: shellcheck, the paths they name, the resources they ask
for, and site.sh's set-up run under bash.

Running them is the job of tests/test_pbs.py (every PBS job, on a real OpenPBS with two
hosts) and tests/test_slurm.py (every Slurm job, on a real Slurm).
"""
import re
import subprocess

import pytest

from cluster_helpers import JOB_SCRIPTS, REPO, STAND_INS, clean_environment, run_job, shellcheck

STEPS = ["01_baseline", "02_allreduce", "03_data_parallel", "04_ddp", "04_ddp_2nodes"]
PBS_JOBS = sorted(JOB_SCRIPTS.glob("*.pbs"))
SLURM_JOBS = sorted(JOB_SCRIPTS.glob("*.sbatch"))
SHELL_FILES = sorted(JOB_SCRIPTS.iterdir()) + sorted(STAND_INS.iterdir()) + sorted((REPO / ".ci").glob("*.sh"))

# What every PBS knows: in a select chunk, and as a job-wide -l resource; and ngpus, the GPU resource many PBS
# sites define (a vanilla PBS does not: CI's defines it, .ci/start_pbs.sh).
STANDARD_CHUNK = {"ncpus", "mem", "mpiprocs", "ompthreads"}
GPU_CHUNK = {"ngpus"}
STANDARD_JOB_WIDE = {"select", "walltime", "place"}

# The GPUs each job asks for, per node, as shipped: what its step needs.
GPUS_PER_NODE = {
    "01_baseline": 1, "06_cifar10_baseline": 1,  # one process on one GPU
    "02_allreduce": 2, "03_data_parallel": 2, "04_ddp": 2, "06_cifar10_ddp": 2,  # two ranks (or DataParallel's 2 GPUs)
    "04_ddp_2nodes": 2, "06_cifar10_ddp_2nodes": 2, "06_finetune_2nodes": 2, "doctor": 2,  # 2 per node, 2 nodes
    "06_model_parallel": 2,  # one replica cut over two GPUs
    "jupyter": 2,  # the notebooks' torchrun cells start 2 processes
}


def names(paths):
    return [path.name for path in paths]


def test_every_step_has_a_pbs_and_a_slurm_job():
    assert set(STEPS) <= {path.stem for path in PBS_JOBS}
    assert set(STEPS) <= {path.stem for path in SLURM_JOBS}


def test_every_pbs_job_has_a_slurm_twin():
    assert {path.stem for path in PBS_JOBS} == {path.stem for path in SLURM_JOBS}


# The source tutorials' jobs: what each trains by default (COURSE_ARGS come after, and can change it).
SEED_JOBS = {
    "06_cifar10_baseline": ("scripts/step1_baseline.py", "--dataset cifar10 --model resnet18 --epochs 2"),
    "06_cifar10_ddp": ("scripts/step4_ddp.py", "--dataset cifar10 --model resnet18 --epochs 2"),
    "06_cifar10_ddp_2nodes": ("scripts/step4_ddp.py", "--dataset cifar10 --model resnet18 --epochs 2"),
    "06_finetune_2nodes": ("scripts/step6_finetune.py", '"${COURSE_START_ARG_LIST[@]}" --epochs 5'),
    "06_model_parallel": ("scripts/step6_model_parallel.py", "--dataset cifar10 --model resnet18 --epochs 2"),
}


@pytest.mark.parametrize("job", [f"{stem}.{kind}" for stem in SEED_JOBS for kind in ("pbs", "sbatch")])
def test_seed_jobs_train_their_system_with_course_args_last(job):
    script, flags = SEED_JOBS[job.split(".")[0]]
    command = " ".join((JOB_SCRIPTS / job).read_text().replace("\\\n", " ").split())
    assert f'{script} {flags} "${{COURSE_TRAIN_ARG_LIST[@]}}"' in command


def test_the_model_parallel_jobs_start_one_process_per_two_gpus():
    for kind in ("pbs", "sbatch"):
        assert "scripts/tools/launch.py --gpus-per-process 2" in (JOB_SCRIPTS / f"06_model_parallel.{kind}").read_text()


TRAINING_JOBS = [path for path in PBS_JOBS + SLURM_JOBS if "COURSE_TRAIN_ARG_LIST" in path.read_text()]


@pytest.mark.parametrize("path", TRAINING_JOBS, ids=names(TRAINING_JOBS))
def test_every_training_job_runs_under_torchrun_so_a_dead_worker_is_restarted(path):
    """Single-process steps too, as a group of one: torchrun --max-restarts restarts it from its checkpoint."""
    command = path.read_text().replace("\\\n", " ")
    assert re.search(r"(scripts/tools/launch\.py|job_scripts/node_launch\.sh|course_pbsdsh)\b.*\bscripts/step\w+\.py",
                     command)
    assert not re.search(r"python scripts/step", command), "a training script started without torchrun"


def test_the_node_launcher_starts_torchrun_through_launch_py():
    """The multi-node PBS jobs' way there: course_pbsdsh (common.sh) runs node_launch.sh, which runs launch.py."""
    assert "python scripts/tools/launch.py" in (JOB_SCRIPTS / "node_launch.sh").read_text()
    course_pbsdsh = re.search(r"^course_pbsdsh\(\) \{\n(.*?)^\}", (JOB_SCRIPTS / "common.sh").read_text(), re.M | re.S)
    assert course_pbsdsh and 'pbsdsh -- /bin/bash "$PWD/job_scripts/node_launch.sh"' in course_pbsdsh[1]


def test_there_are_training_jobs_of_one_process_and_of_many():
    stems = {path.stem for path in TRAINING_JOBS}
    assert {"01_baseline", "03_data_parallel", "06_cifar10_baseline", "04_ddp", "04_ddp_2nodes"} <= stems


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


def resource_lines(text, prefix="#PBS"):
    """The -l resources of the lines that start with PREFIX ("#PBS": what qsub reads)."""
    return [value for value in re.findall(rf"^{prefix} -l (\S+)$", text, re.M)]


@pytest.mark.parametrize("path", PBS_JOBS, ids=names(PBS_JOBS))
def test_pbs_jobs_ask_only_for_what_every_pbs_has(path):
    text = path.read_text()
    for resource in resource_lines(text):
        name, _, value = resource.partition("=")
        assert name in STANDARD_JOB_WIDE, f"{path.name}: -l {resource} is not known to every PBS"
        if name == "select":
            chunk_keys = {part.partition("=")[0] for part in value.split(":")[1:]}
            assert chunk_keys <= STANDARD_CHUNK | GPU_CHUNK, (
                f"{path.name}: {resource} names {chunk_keys - STANDARD_CHUNK - GPU_CHUNK}")
    assert not re.search(r"^#PBS -(q|A)\b", text, re.M), "a queue or project is site-specific: site.sh shows them"
    assert re.search(r"^#PBS -l walltime=\d+:\d\d:\d\d$", text, re.M)
    assert 'cd "${PBS_O_WORKDIR' in text


def pbs_gpus_per_node(text):
    select = next(r for r in resource_lines(text) if r.startswith("select="))
    ngpus = re.search(r":ngpus=(\d+)", select)
    return int(ngpus.group(1)) if ngpus else 0


def slurm_gpus_per_node(text):
    gres = re.search(r"^#SBATCH --gres=gpu:(\d+)$", text, re.M)
    return int(gres.group(1)) if gres else 0


def test_every_job_is_listed_with_the_gpus_it_needs():
    assert set(GPUS_PER_NODE) == {path.stem for path in PBS_JOBS}


@pytest.mark.parametrize("job", sorted(GPUS_PER_NODE))
def test_every_job_asks_for_the_gpus_its_step_needs_as_shipped(job):
    """The PBS job and its Slurm twin ask for the same GPUs per node, on their active lines: nothing to uncomment."""
    pbs, slurm = (JOB_SCRIPTS / f"{job}.pbs").read_text(), (JOB_SCRIPTS / f"{job}.sbatch").read_text()
    assert (pbs_gpus_per_node(pbs), slurm_gpus_per_node(slurm)) == (GPUS_PER_NODE[job],) * 2
    assert "##PBS" not in pbs


def test_the_gpu_count_readers_can_fail():
    assert pbs_gpus_per_node("#PBS -l select=1:ncpus=8:mem=16gb\n##PBS -l select=1:ncpus=8:ngpus=1\n") == 0
    assert slurm_gpus_per_node("#SBATCH --gres=none\n# #SBATCH --gres=gpu:2\n") == 0


@pytest.mark.parametrize("job", names(JOB_SCRIPTS.glob("*_2nodes.pbs")))
def test_the_2node_job_asks_for_one_chunk_per_host(job):
    text = (JOB_SCRIPTS / job).read_text()
    select = next(r for r in resource_lines(text) if r.startswith("select="))
    assert select.startswith("select=2:") and "mpiprocs=1" in select and "place=scatter" in resource_lines(text)


def test_outside_a_job_the_script_says_so(tmp_path):
    result = run_job(JOB_SCRIPTS / "04_ddp.pbs", clean_environment(), cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    assert "PBS_O_WORKDIR: is not set: submit this with qsub" in result.stdout


# ---------------------------------------------------------------- site.sh and common.sh under bash

def bash_in_course(script, env=None, timeout=60):
    """Run SCRIPT with common.sh sourced, in the course directory, without a module system."""
    env = dict(env or clean_environment())
    for name in ("MODULESHOME", "LOADEDMODULES", "BASH_ENV", "CONDA_EXE"):
        env.pop(name, None)
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source job_scripts/common.sh; {script}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_modules_asked_for_without_a_module_command_is_an_error():
    env = clean_environment()
    env["COURSE_MODULES"] = "cuda/12.4"
    result = bash_in_course("site_load_modules; echo loaded", env)
    assert result.returncode == 1 and "loaded" not in result.stdout
    assert result.stderr.strip() == (
        "job: error: modules are asked for (COURSE_MODULES='cuda/12.4') but this shell has no 'module' command; "
        "set COURSE_MODULES=\"\" and COURSE_MODULE_PATH=\"\" in job_scripts/site.sh, or ask your site how batch jobs "
        "load modules"
    )


def test_no_modules_by_default():
    result = bash_in_course('site_load_modules; echo "modules=[$COURSE_MODULES]"')
    assert result.returncode == 0 and "modules=[]" in result.stdout


def test_conda_asked_for_without_conda_is_an_error(tmp_path):
    env = clean_environment()
    env.update(COURSE_VENV=str(tmp_path / "no-venv"), COURSE_CONDA_ENV="ddp-course", PATH="/usr/bin:/bin")
    result = bash_in_course("site_activate_python", env)
    assert result.returncode == 1
    assert "no conda on PATH to activate 'ddp-course'" in result.stderr and "COURSE_MODULES" in result.stderr


def test_the_setup_a_node_takes_over_is_what_site_sh_changed(tmp_path):
    """course_setup in the job shell, then course_load_setup in a bare shell, as a pbsdsh task gets."""
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "envs" / "course" / "bin").mkdir(parents=True)
    (conda / "bin" / "conda").write_bytes((STAND_INS / "conda").read_bytes())
    (conda / "bin" / "conda").chmod(0o755)
    python = conda / "envs" / "course" / "bin" / "python"
    python.symlink_to("/bin/true")
    env = clean_environment()
    env.update(COURSE_VENV="", COURSE_CONDA_ENV="course", PATH=f"{conda / 'bin'}:/usr/bin:/bin", UNTOUCHED="1")
    saved = tmp_path / "setup.env"
    job = bash_in_course(f"umask 022; course_setup; course_save_setup {saved}", env)
    assert job.returncode == 0, job.stderr
    text = saved.read_text()
    assert f"export COURSE_PYTHON={python}" in text and f"export CONDA_PREFIX={conda}/envs/course" in text
    assert "UNTOUCHED" not in text and "umask 0022" in text  # what the set-up left alone stays out
    task = subprocess.run(
        ["env", "-i", "PATH=/bin:/usr/bin", f"HOME={tmp_path}", "bash", "-c",
         f"set -euo pipefail; umask 077; source job_scripts/common.sh; course_load_setup {saved}; "
         'echo "python=$(command -v python) umask=$(umask) prefix=$CONDA_PREFIX"'],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert task.returncode == 0, task.stderr
    assert task.stdout.strip() == f"python={python} umask=0022 prefix={conda}/envs/course"


def test_a_node_that_cannot_run_the_jobs_python_says_so(tmp_path):
    saved = tmp_path / "setup.env"
    saved.write_text("export COURSE_PYTHON=/scratch/node-local/venv/bin/python\n")
    task = subprocess.run(
        ["env", "-i", "PATH=/bin:/usr/bin", "bash", "-c",
         f"set -euo pipefail; source job_scripts/common.sh; course_load_setup {saved}"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert task.returncode == 1
    assert "cannot run /scratch/node-local/venv/bin/python, the python the job shell set up" in task.stderr
    assert "a file system every node sees" in task.stderr
