# shellcheck shell=bash
# Helpers shared by the job scripts; nothing here is site-specific (that is site.sh).
# Sourced from the course directory: every job changes to it first.

course_fail() {
    echo "job: error: $*" >&2
    exit 1
}

[[ -f job_scripts/site.sh ]] || course_fail "run from the course directory ($PWD has no job_scripts/site.sh)"

# When the job started: the clock of the walltime, which the training scripts' --stop-after counts
# from (scripts/machinery/walltime.py). A multi-node job hands it to its other nodes.
: "${COURSE_JOB_START:=$(date +%s)}"
export COURSE_JOB_START
# Slurm's warning (--signal=B:USR1@...) may come up to a minute early, even before the run starts:
# noted here, it becomes the run's stop request in course_train (USR1 would end the shell otherwise).
COURSE_STOP_ASKED=""
trap 'COURSE_STOP_ASKED=1' USR1
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
# --max-restarts), and a follow-up job (course_continue, below) that is given the folder:
# qsub -v COURSE_CHECKPOINT_DIR=checkpoints/ddp04_ddp-1234.server JOB
# (the same COURSE_ARGS, or the checkpoint is refused as another run's).
course_checkpoint_dir() {
    local name=${PBS_JOBNAME:-${SLURM_JOB_NAME:-job}} id=${PBS_JOBID:-${SLURM_JOB_ID:-$$}}
    echo "checkpoints/$name-${id//[^A-Za-z0-9_.-]/_}"
}
: "${COURSE_CHECKPOINT_DIR:=$(course_checkpoint_dir)}"

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
    course_read_time_limit
}

# The job's time limit, as flags for the training script, before COURSE_ARGS (which can
# override them). The run stops with a checkpoint before the limit, and the job continues
# in a follow-up job (course_continue):
# - PBS sends no warning before the walltime, so the run is given the walltime itself
#   (--stop-after; qstat -f: Resource_List.walltime) and stops --stop-margin seconds (30)
#   plus a step and a checkpoint before it;
# - Slurm sends the job shell SIGUSR1 ahead of the limit (the jobs' #SBATCH --signal=B:USR1@...);
#   course_run turns it into a stop request for the run.
# Both: --grace-period, the seconds between the scheduler's SIGTERM (qdel, scancel, the
# limit) and its SIGKILL (PBS: the queue's kill_delay, 10 by default; Slurm: KillWait), which
# the run checks a checkpoint fits in. torchrun, after passing a SIGTERM on, SIGKILLs its
# workers --shutdown-timeout seconds later (30 by default): TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
# which torchrun reads as a whole number, is set to the same grace, rounded up, so that
# torchrun waits as long as the scheduler does.
course_read_time_limit() {
    local walltime="" grace=""
    COURSE_LIMIT_ARG_LIST=() COURSE_LIMIT_TEXT=""
    if [[ -n ${PBS_JOBID:-} ]] && command -v qstat >/dev/null; then
        # A qstat that fails (a server this node cannot reach) leaves them empty: the job runs without a budget.
        walltime=$(course_walltime) || walltime=""
        grace=$(qstat -Qf "${PBS_QUEUE:-}" 2>/dev/null | awk '$1 == "kill_delay" {print $3}') || grace=""
        grace=${grace:-10}  # OpenPBS's default kill_delay (pbs_queue_attributes(7B))
        if [[ -n $walltime ]]; then
            COURSE_LIMIT_ARG_LIST+=(--stop-after "$walltime")
            COURSE_LIMIT_TEXT="walltime $walltime (qstat -f): the run stops with a checkpoint before it, and the job submits its follow-up"
        fi
        COURSE_LIMIT_TEXT+="${COURSE_LIMIT_TEXT:+; }SIGTERM to SIGKILL: $grace s (the queue's kill_delay)"
    elif [[ -n ${SLURM_JOB_ID:-} ]] && command -v scontrol >/dev/null; then
        grace=$(scontrol show config 2>/dev/null | awk '$1 == "KillWait" {print $3}') || grace=""
        COURSE_LIMIT_TEXT="SIGUSR1 ahead of it (--signal=B:USR1@...) asks the run to stop with a checkpoint, and the job requeues itself${grace:+; SIGTERM to SIGKILL: $grace s (KillWait)}"
    fi
    if [[ -n $grace ]]; then
        COURSE_LIMIT_ARG_LIST+=(--grace-period "$grace")
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$(awk -v g="$grace" 'BEGIN {s = int(g); if (s < g) s++; print s}')
        export TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    fi
    # The training script's arguments: these first, so that COURSE_ARGS can override them.
    # shellcheck disable=SC2034  # used by the job scripts that source this file
    COURSE_TRAIN_ARG_LIST=(--resume --checkpoint-dir "$COURSE_CHECKPOINT_DIR" "${COURSE_LIMIT_ARG_LIST[@]}"
        "${COURSE_ARG_LIST[@]}")
}

# The PBS job's walltime as qstat -f gives it (Resource_List.walltime: HH:MM:SS); nothing where
# the job has none, and a failure where qstat fails.
course_walltime() {
    qstat -f "$PBS_JOBID" 2>/dev/null | awk '$1 == "Resource_List.walltime" {print $3}'
}

# Write what course_setup changed, and the umask, as a script that another node sources.
course_save_setup() {
    local name
    {
        echo "# The environment job_scripts/site.sh set up in the job shell on $(hostname)."
        for name in "${COURSE_SETUP_CHANGED[@]}"; do printf 'export %s=%q\n' "$name" "${!name}"; done
        for name in "${COURSE_SETUP_REMOVED[@]}"; do printf 'unset %s\n' "$name"; done
        printf 'export COURSE_JOB_START=%q\n' "$COURSE_JOB_START"
        [[ -z ${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-} ]] ||
            printf 'export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=%q\n' "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
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

# The PBS job's hosts, one a line, each once, in the order of PBS_NODEFILE (which may list a
# host more than once).
course_pbs_hosts() {
    awk 'NF && !seen[$1]++ {print $1}' "$PBS_NODEFILE"
}

# The run of a multi-node PBS job, in one place for every such job: pbsdsh runs
# job_scripts/node_launch.sh once on every host of the job, each with LAUNCH_ARGS for
# scripts/tools/launch.py, which becomes that host's torchrun.
#   course_pbsdsh RUN [LAUNCH_ARGS...]
# RUN runs pbsdsh in the job shell: course_train for a training run (its time limit, its signals,
# its follow-up), or command to run it as it is. pbsdsh itself exits 0 always, so the job's status
# is the nodes' own: each is printed, and a node that did not exit 0 fails the job with the line
# COURSE_NODES_FAILED (a job whose nodes do something other than train sets its own).
COURSE_NODES_FAILED="training failed on at least one node (status 'none': the node never ran node_launch.sh)"
course_pbsdsh() {
    local run=$1 node node_status status=0
    local -a hosts
    shift
    # pbsdsh starts one task per line of the node file: a host listed twice would get two.
    mapfile -t hosts < <(course_pbs_hosts)
    (($(grep -c . "$PBS_NODEFILE") == ${#hosts[@]})) ||
        course_fail "PBS_NODEFILE lists a host more than once ($(grep . "$PBS_NODEFILE" | paste -sd ' ' -)), so" \
            "pbsdsh would start two launchers on it; ask for one chunk per host: mpiprocs=1 and -l place=scatter"

    # A folder on the shared file system, seen by every node, for this job only (cleared
    # first: a rerun job keeps its id). It holds the node file, the environment site.sh set
    # up here, and each node's exit status. It is removed when the job shell exits.
    COURSE_JOB_DIR="$PWD/.pbs_job.$PBS_JOBID"
    rm -rf "$COURSE_JOB_DIR"
    mkdir -p "$COURSE_JOB_DIR"
    trap 'rm -rf "$COURSE_JOB_DIR"' EXIT
    cp "$PBS_NODEFILE" "$COURSE_JOB_DIR/nodefile"
    course_save_setup "$COURSE_JOB_DIR/setup.env"

    echo "== pbsdsh: node_launch.sh on ${#hosts[@]} node(s): ${hosts[*]}"
    "$run" pbsdsh -- /bin/bash "$PWD/job_scripts/node_launch.sh" "$PWD" "$COURSE_JOB_DIR" "$@"

    for node in "${!hosts[@]}"; do
        node_status=$(cat "$COURSE_JOB_DIR/node$node.status" 2>/dev/null || echo "none")
        echo "== node $node (${hosts[node]}): exit status $node_status"
        [[ $node_status == 0 ]] || status=1
    done
    if ((status != 0)); then
        echo "job: error: $COURSE_NODES_FAILED" >&2
    fi
    return "$status"
}

# What a job log should start with: where it ran, on which GPUs, with which versions.
course_log_env() {
    echo "== job ${PBS_JOBID:-${SLURM_JOB_ID:-(no job id)}} on $(hostname), $(date '+%Y-%m-%d %H:%M:%S')"
    echo "== course directory: $PWD"
    echo "== checkpoints: $COURSE_CHECKPOINT_DIR (the job resumes from the newest there)"
    if [[ -n ${PBS_NODEFILE:-} && -r ${PBS_NODEFILE:-} ]]; then
        echo "== nodes (PBS_NODEFILE): $(course_pbs_hosts | paste -sd ' ' -)"
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

# Run a command; report and return its exit status (the job's, under set -e).
course_run() {
    local start=$SECONDS status=0
    echo "== running: $*"
    "$@" || status=$?
    echo "== exit status $status after $((SECONDS - start)) s"
    return "$status"
}

# Run the training command as course_run does, then continue the job if the run stopped early
# (course_continue). The command runs in the background, so that a signal to the job shell is
# handled at once:
# - SIGUSR1 (Slurm's warning, #SBATCH --signal=B:USR1@...): a stop request for the run, the
#   file STOP in its checkpoint folder, which rank 0 looks for at every step boundary;
# - SIGTERM (qdel, scancel, the limit itself): noted, for course_continue; the scheduler
#   sends SIGTERM to the run's processes too, and they stop with a checkpoint.
course_train() {
    local start=$SECONDS status=0 pid last
    mkdir -p "$COURSE_CHECKPOINT_DIR"
    rm -f "$COURSE_CHECKPOINT_DIR/STOP"  # news of an earlier job is old
    COURSE_RUN_BEGAN=$(date +%s)  # a STOPPED note older than this is another run's (course_continue)
    COURSE_SIGTERM_AT=""
    trap 'COURSE_SIGTERM_AT=${COURSE_SIGTERM_AT:-$SECONDS}' TERM
    trap 'course_ask_to_stop' USR1
    [[ -z $COURSE_STOP_ASKED ]] || course_ask_to_stop
    if [[ -n ${COURSE_LIMIT_TEXT:-} ]]; then echo "== time limit: $COURSE_LIMIT_TEXT"; fi
    echo "== running: $*"
    "$@" &
    pid=$!
    while :; do
        wait "$pid" && status=0 || status=$?
        # A trap interrupts wait with 128 + its signal while the command goes on: wait again.
        if ((status <= 128)) || ! kill -0 "$pid" 2>/dev/null; then break; fi
    done
    if ((status > 128)); then  # the command may have ended just as a trap interrupted wait
        last=0
        wait "$pid" 2>/dev/null || last=$?
        ((last == 127)) || status=$last  # 127: the wait above had its status already
    fi
    trap 'COURSE_STOP_ASKED=1' USR1  # too late for this run: noted, and ignored
    trap - TERM
    echo "== exit status $status after $((SECONDS - start)) s"
    course_continue || status=$?
    return "$status"
}

course_ask_to_stop() {
    echo "== SIGUSR1: the time limit is near; asking the run to stop (touch $COURSE_CHECKPOINT_DIR/STOP)"
    touch "$COURSE_CHECKPOINT_DIR/STOP"
}

# After a run that stopped early with a checkpoint (its note, STOPPED in the checkpoint
# folder: the reason and the step), the job continues by itself where the reason was the
# time limit: PBS submits a follow-up job that resumes from the folder
# (scripts/tools/resubmit.py: qsub -W depend=afterany:<this job>); Slurm requeues this job
# (scontrol requeue: the same id, so the same folder); not where site.sh says COURSE_CONTINUE=no.
# A run that finished or failed leaves no note, so nothing follows it: a bad input never loops,
# and every job of a chain trains at least one step (the run writes no note without one). The
# run removes an earlier run's note once it holds the folder (graceful_stop.py).
course_continue() {
    local reason step note=$COURSE_CHECKPOINT_DIR/STOPPED
    [[ -f $note ]] || return 0
    # This run's note, not one an earlier job left, nor one of a run that holds the folder (folder_lock.py).
    (($(stat -c %Y "$note") >= ${COURSE_RUN_BEGAN:-0})) || return 0
    read -r reason step <"$COURSE_CHECKPOINT_DIR/STOPPED"
    if [[ $COURSE_CONTINUE != yes ]]; then
        :  # the site chains its jobs itself (job_scripts/site.sh)
    elif [[ -n ${PBS_JOBID:-} ]]; then
        if [[ $reason == time-budget ]] || { [[ $reason == SIGTERM ]] && course_past_walltime; }; then
            python scripts/tools/resubmit.py "$COURSE_CHECKPOINT_DIR"
            return
        fi
    elif [[ -n ${SLURM_JOB_ID:-} && ($reason == stop-request || $reason == SIGUSR1) ]]; then
        echo "== requeued: job $SLURM_JOB_ID continues from $COURSE_CHECKPOINT_DIR (scontrol requeue)"
        scontrol requeue "$SLURM_JOB_ID"
        return
    fi
    echo "== stopped at step $step ($reason), not continued: resubmit with COURSE_CHECKPOINT_DIR=$COURSE_CHECKPOINT_DIR to go on"
}

# True when the job's SIGTERM came at the walltime (qdel before it is the user's wish to stop).
course_past_walltime() {
    local walltime seconds=0 part
    walltime=$(course_walltime) || return 1
    [[ -n $walltime && -n $COURSE_SIGTERM_AT ]] || return 1
    for part in ${walltime//:/ }; do seconds=$((seconds * 60 + 10#$part)); done
    ((COURSE_SIGTERM_AT + $(date +%s) - SECONDS - COURSE_JOB_START + 5 >= seconds))
}
