# shellcheck shell=bash
# Helpers shared by the job scripts; nothing here is site-specific (that is site.sh).
# Sourced from the course directory: every job changes to it first.

course_fail() {
    echo "job: error: $*" >&2
    exit 1
}

[[ -f job_scripts/site.sh ]] || course_fail "run from the course directory ($PWD has no job_scripts/site.sh)"
# shellcheck source=job_scripts/site.sh
source job_scripts/site.sh

# Extra arguments, split at spaces (no quoting inside):
#   COURSE_ARGS         for the training script: "--epochs 1 --batch-size 128"
#   COURSE_LAUNCH_ARGS  for scripts/tools/launch.py (jobs that use it): "--port 23456", "--nproc-per-node 1"
# Pass them at submission:
#   qsub -v COURSE_ARGS="--epochs 1",COURSE_LAUNCH_ARGS="--port 23456" job_scripts/04_ddp_2nodes.pbs
#   COURSE_ARGS="--epochs 1" sbatch job_scripts/04_ddp.sbatch
# shellcheck disable=SC2034  # used by the job scripts that source this file
read -r -a COURSE_ARG_LIST <<<"${COURSE_ARGS:-}"
# shellcheck disable=SC2034
read -r -a COURSE_LAUNCH_ARG_LIST <<<"${COURSE_LAUNCH_ARGS:-}"

# Checkpoints. Every job trains with --resume into a checkpoint folder of its own,
# checkpoints/<job name>-<job id> by default, so that a job the scheduler runs again
# under the same id (PBS: qrerun, a node failure; Slurm: requeue) continues from its
# last checkpoint, as does a worker group that torchrun restarts (scripts/tools/launch.py
# --max-restarts). To continue a job that ran out of walltime, submit it again with its
# folder: qsub -v COURSE_CHECKPOINT_DIR=checkpoints/ddp04_ddp-1234.server JOB
# (the same COURSE_ARGS, or the checkpoint is refused as another run's).
course_checkpoint_dir() {
    local name=${PBS_JOBNAME:-${SLURM_JOB_NAME:-job}} id=${PBS_JOBID:-${SLURM_JOB_ID:-$$}}
    echo "checkpoints/$name-${id//[^A-Za-z0-9_.-]/_}"
}
: "${COURSE_CHECKPOINT_DIR:=$(course_checkpoint_dir)}"
# The training script's arguments: these first, so that COURSE_ARGS can override them.
# shellcheck disable=SC2034
COURSE_TRAIN_ARG_LIST=(--resume --checkpoint-dir "$COURSE_CHECKPOINT_DIR" "${COURSE_ARG_LIST[@]}")

# Load the modules and the Python environment named in site.sh, and remember what that
# changed in the environment (COURSE_SETUP_CHANGED, COURSE_SETUP_REMOVED): a multi-node
# job hands exactly that to its other nodes (course_save_setup).
course_setup() {
    local -A before=()
    local name
    for name in $(compgen -e); do before[$name]=${!name}; done
    site_load_modules
    site_activate_python
    command -v python >/dev/null || course_fail "no python on PATH after the setup in job_scripts/site.sh"
    COURSE_PYTHON=$(command -v python)
    export COURSE_PYTHON
    COURSE_SETUP_CHANGED=() COURSE_SETUP_REMOVED=()
    for name in $(compgen -e); do
        case $name in _ | PWD | OLDPWD | SHLVL) continue ;; esac
        [[ -v "before[$name]" && ${before[$name]} == "${!name}" ]] || COURSE_SETUP_CHANGED+=("$name")
    done
    for name in "${!before[@]}"; do
        [[ -v $name ]] || COURSE_SETUP_REMOVED+=("$name")
    done
}

# Write what course_setup changed, and the umask, as a script that another node sources.
course_save_setup() {
    local name
    {
        echo "# The environment job_scripts/site.sh set up in the job shell on $(hostname)."
        for name in "${COURSE_SETUP_CHANGED[@]}"; do printf 'export %s=%q\n' "$name" "${!name}"; done
        for name in "${COURSE_SETUP_REMOVED[@]}"; do printf 'unset %s\n' "$name"; done
        echo "umask $(umask)"
    } > "$1"
}

# On another node: take over the job shell's setup, and check that its Python is here.
course_load_setup() {
    local expected
    # shellcheck source=/dev/null
    source "$1"
    expected=${COURSE_PYTHON:?is not set in $1}
    [[ -x $expected ]] ||
        course_fail "$(hostname) cannot run $expected, the python the job shell set up: put the course's Python environment on a file system every node sees"
    [[ $(command -v python) == "$expected" ]] ||
        course_fail "python on $(hostname) is $(command -v python), not $expected as in the job shell; check PATH in job_scripts/site.sh"
}

# What a job log should start with: where it ran, on which GPUs, with which versions.
course_log_env() {
    echo "== job ${PBS_JOBID:-${SLURM_JOB_ID:-(no job id)}} on $(hostname), $(date '+%Y-%m-%d %H:%M:%S')"
    echo "== course directory: $PWD"
    echo "== checkpoints: $COURSE_CHECKPOINT_DIR (the job resumes from the newest there)"
    if [[ -n ${PBS_NODEFILE:-} && -r ${PBS_NODEFILE:-} ]]; then
        echo "== nodes (PBS_NODEFILE): $(awk 'NF && !seen[$1]++ {print $1}' "$PBS_NODEFILE" | paste -sd ' ' -)"
    elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
        echo "== nodes (SLURM_JOB_NODELIST): $SLURM_JOB_NODELIST"
    fi
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L || echo "== nvidia-smi failed: is the driver loaded on this node?"
        echo "== NVIDIA driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    else
        echo "== GPUs: none (no nvidia-smi on this node)"
    fi
    if [[ -n ${LOADEDMODULES:-} ]]; then echo "== modules: ${LOADEDMODULES//:/ }"; fi
    echo "== python: $(command -v python) ($(python --version 2>&1))"
    python -c '
import torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or "none"
print(f"== torch {torch.__version__}, built for CUDA {torch.version.cuda}; GPUs torch can use: {gpus} ({names})")
' || course_fail "python could not import torch; check the environment set up by job_scripts/site.sh"
}

# Run the training command; report and return its exit status (the job's, under set -e).
course_run() {
    local start=$SECONDS status=0
    echo "== running: $*"
    "$@" || status=$?
    echo "== exit status $status after $((SECONDS - start)) s"
    return "$status"
}
