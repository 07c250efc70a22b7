#!/bin/bash
# Start a small Slurm cluster on this machine, for tests/test_slurm.py.
#
#   sudo bash .ci/start_slurm.sh
#
# - installs Debian's slurm-wlm and munge (and shellcheck, for the job-script tests)
#   when they are missing;
# - writes /etc/slurm/slurm.conf (Slurm's default location, so sbatch, srun, squeue and
#   scontrol need no SLURM_CONF): one partition "course" with TWO nodes that are both
#   this machine, each its own slurmd. That lets the 2-node sbatch job run for real.
#   The nodes are named HOST and HOST-2 (HOST = `hostname -s`): the launcher uses the
#   first node's name as the rendezvous host, so that one must resolve, and Slurm
#   sorts node names, so the other must sort after it. ("localhost" cannot be a
#   node name: slurmctld then sees two nodes with one host name and stops.)
#   Each node advertises 4 GPUs that do not exist (/etc/slurm/gres.conf: empty files as
#   their devices), so the jobs run with their GPU request as shipped.
# - starts munged, slurmctld and the two slurmd, and waits until both nodes are idle.
#
# Idempotent: what already runs is left running, and a second call only checks.
# It touches no slurm.conf it did not write. Needs root (apt-get, daemons).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
# GPUs each node advertises (none exist), so that jobs run with their --gres=gpu:N as shipped.
GPUS_PER_NODE=4
MARKER="# Written by .ci/start_slurm.sh (data-parallel course CI); safe to delete."
STATE=/var/lib/slurm-course
LOGS=/var/log/slurm-course
NODE_PORTS=(6818 6828)

say() { echo "start_slurm: $*"; }
die() { echo "start_slurm: error: $*" >&2; exit 1; }

# ---------------------------------------------------------------- packages
missing=()
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
command -v shellcheck >/dev/null || missing+=(shellcheck)
if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || die "missing ${missing[*]}; run as root to install them"
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge shellcheck >/dev/null
fi

# ---------------------------------------------------------------- munge (Slurm's authentication)
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [[ $(id -u) == 0 ]] || die "munged is not running; run as root to start it"
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge: /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge
    chown munge: /run/munge
    say "starting munged"
    runuser -u munge -- munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
    munge -n | unmunge >/dev/null || die "munged did not start"
fi

# ---------------------------------------------------------------- slurm.conf
if [[ -e $CONF ]] && ! grep -qxF "$MARKER" "$CONF"; then
    say "$CONF was not written by this script; leaving it and its daemons alone"
    sinfo >/dev/null || die "the existing Slurm does not answer (sinfo failed)"
    exit 0
fi

short_host=$(hostname -s)
[[ $short_host != localhost ]] || die "this machine's host name is 'localhost'; give it another (hostname NAME)"
getent hosts "$short_host" >/dev/null || die "host name $short_host does not resolve; add it to /etc/hosts"
NODES=("$short_host" "$short_host-2")
cpus=$(nproc)
memory_mb=$(( $(awk '/^MemTotal/ {print $2}' /proc/meminfo) * 9 / 10 / 1024 ))
new_conf=$(cat <<EOF
$MARKER
# A two-node cluster on one machine: both nodes are this host, each with its own slurmd
# (slurmd -N NAME). Both see all $cpus CPUs; jobs here are small.
ClusterName=course
SlurmctldHost=$short_host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=/run/slurmctld-course.pid
SlurmdPidFile=/run/slurmd-course-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
# What works in a container (COURSE_NOTES section 3): no cgroups.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# Keep finished jobs visible to 'scontrol show job' for 10 minutes (no accounting database).
MinJobAge=600
# A requeued job may start again after this many seconds (the default, 120, would make
# the test of requeueing wait two minutes).
AuthInfo=cred_expire=10
# GPUs that do not exist (gres.conf), so jobs are granted their --gres=gpu:N (SLURM_GPUS_ON_NODE,
# CUDA_VISIBLE_DEVICES) and torch sees no GPU.
GresTypes=gpu
NodeName=${NODES[0]} NodeHostname=$short_host NodeAddr=127.0.0.1 Port=${NODE_PORTS[0]} CPUs=$cpus RealMemory=$memory_mb Gres=gpu:$GPUS_PER_NODE State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=$short_host NodeAddr=127.0.0.1 Port=${NODE_PORTS[1]} CPUs=$cpus RealMemory=$memory_mb Gres=gpu:$GPUS_PER_NODE State=UNKNOWN
PartitionName=course Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
)

# Is the daemon of this pid file running? (The pid is checked to be a Slurm daemon: after a
# restart of the machine an old pid file may name some other process.)
pid_alive() {
    local pid
    [[ -s $1 ]] && pid=$(cat "$1") && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurm* ]]
}
daemon_pidfiles=(/run/slurmctld-course.pid)
for node in "${NODES[@]}"; do daemon_pidfiles+=("/run/slurmd-course-$node.pid"); done

# Slurm drops a gpu GRES without device files ("Removing file-less GPU"), so each node's GPUs are
# empty files standing in for /dev/nvidia0..3. Nothing opens them: with TaskPlugin=task/none, Slurm
# confines no device; it only counts them. (slurmd logs "... is not a valid character or block
# device, fix your gres.conf" for each at its start, and goes on.)
FAKE_GPU_DIR=$STATE/fake-gpus
new_gres_conf=$(printf '%s\n' "$MARKER" \
    "NodeName=${NODES[0]} Name=gpu File=$FAKE_GPU_DIR/nvidia[0-$((GPUS_PER_NODE - 1))]" \
    "NodeName=${NODES[1]} Name=gpu File=$FAKE_GPU_DIR/nvidia[0-$((GPUS_PER_NODE - 1))]")

if [[ ! -e $CONF ]] || [[ "$(cat "$CONF")" != "$new_conf" ]] ||
    [[ ! -e $GRES_CONF ]] || [[ "$(cat "$GRES_CONF")" != "$new_gres_conf" ]]; then
    [[ $(id -u) == 0 ]] || die "cannot write $CONF; run as root"
    # A changed configuration: stop the daemons this script started before (by their pid files).
    for pidfile in "${daemon_pidfiles[@]}"; do
        if pid_alive "$pidfile"; then
            pid=$(cat "$pidfile")
            say "stopping pid $pid ($pidfile) for the new configuration"
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        fi
    done
    mkdir -p "$(dirname "$CONF")"
    printf '%s\n' "$new_conf" > "$CONF"
    printf '%s\n' "$new_gres_conf" > "$GRES_CONF"
    say "wrote $CONF and $GRES_CONF"
fi
for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
    [[ -e $FAKE_GPU_DIR/nvidia$gpu ]] || { mkdir -p "$FAKE_GPU_DIR" && touch "$FAKE_GPU_DIR/nvidia$gpu"; }
done

# ---------------------------------------------------------------- daemons
mkdir -p "$STATE/ctld" "$LOGS"
for node in "${NODES[@]}"; do mkdir -p "$STATE/$node"; done

if ! pid_alive /run/slurmctld-course.pid; then
    say "starting slurmctld"
    slurmctld
fi
for _ in $(seq 50); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
scontrol ping | grep -q UP || die "slurmctld did not come up; see $LOGS/slurmctld.log"

for node in "${NODES[@]}"; do
    if ! pid_alive "/run/slurmd-course-$node.pid"; then
        say "starting slurmd for node $node"
        slurmd -N "$node"
    fi
done

# ---------------------------------------------------------------- wait for idle nodes
for _ in $(seq 120); do
    states=$(sinfo -h -N -p course -o '%N %T' | sort -u)
    if ! grep -qv ' idle$\| mixed$\| allocated$' <<<"$states"; then
        say "Slurm is up:"
        sinfo -p course
        exit 0
    fi
    # A node left down or drained by an earlier run comes back here.
    while read -r node state; do
        case $state in
            down*|drain*|fail*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
    done <<<"$states"
    sleep 0.5
done
die "the nodes did not become idle: $(sinfo -h -N -o '%N %T' | tr '\n' ' '); see $LOGS/"
