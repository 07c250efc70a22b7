#!/bin/bash
# One node's part of a multi-node PBS job. pbsdsh starts it on every node (see
# 04_ddp_2nodes.pbs); it runs scripts/launch.py, which becomes this node's torchrun.
#
#   node_launch.sh COURSE_DIR JOB_ID JOB_DIR [LAUNCH_OPTIONS...] SCRIPT [SCRIPT_ARGS...]
#
# Everything after JOB_DIR goes to scripts/launch.py as it is.
#
# A pbsdsh task starts in the home directory, with the job's initial environment plus
# PBS_NODENUM (this node's index), and nothing of what the job script did: no cd, no
# modules, no Python environment. Hence the arguments, and the setup done again here.
# JOB_DIR holds a copy of the node file and receives node<PBS_NODENUM>.status.
set -euo pipefail
if (($# < 4)); then
    echo "usage: node_launch.sh COURSE_DIR JOB_ID JOB_DIR [LAUNCH_OPTIONS...] SCRIPT [SCRIPT_ARGS...]" >&2
    exit 2
fi
course_dir=$1
job_dir=$3
node=${PBS_NODENUM:?is not set: this runs under pbsdsh, inside a PBS job}
# Whatever happens below, the job script learns this node's exit status.
trap 'echo $? > "$job_dir/node$node.status"' EXIT
export PBS_O_WORKDIR=$course_dir PBS_JOBID=$2 PBS_NODEFILE=$job_dir/nodefile
shift 3

cd "$course_dir"
# shellcheck source=job_scripts/common.sh
source job_scripts/common.sh
course_setup
echo "== node $node: $(hostname), python $(command -v python)"
python scripts/launch.py "$@"
