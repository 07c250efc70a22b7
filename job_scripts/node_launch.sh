#!/bin/bash
# One node's part of a multi-node PBS job. pbsdsh starts it on every node (see
# 04_ddp_2nodes.pbs); it runs scripts/tools/launch.py, which becomes this node's torchrun.
#
#   node_launch.sh COURSE_DIR JOB_DIR [LAUNCH_OPTIONS...] SCRIPT [SCRIPT_ARGS...]
#
# Everything after JOB_DIR goes to scripts/tools/launch.py as it is.
#
# A pbsdsh task gets nothing of what the job script did: it starts in the home
# directory, with PATH=/bin:/usr/bin, umask 077, no login shell (so no `module`
# command and no conda), and the job's first environment plus PBS_NODENUM, this
# host's index. So the job script leaves in JOB_DIR, on the shared file system, a copy
# of the node file (the other hosts may have none) and setup.env, the environment
# site.sh set up in the job shell; this script takes both over, and leaves this node's
# exit status in JOB_DIR/node<PBS_NODENUM>.status, since pbsdsh itself exits 0 always.
set -euo pipefail
if (($# < 3)); then
    echo "usage: node_launch.sh COURSE_DIR JOB_DIR [LAUNCH_OPTIONS...] SCRIPT [SCRIPT_ARGS...]" >&2
    exit 2
fi
course_dir=$1
job_dir=$2
shift 2
node=${PBS_NODENUM:?is not set: this runs under pbsdsh, inside a PBS job}
# Whatever happens below, the job script learns this node's exit status.
trap 'echo $? > "$job_dir/node$node.status"' EXIT
export PBS_NODEFILE=$job_dir/nodefile

cd "$course_dir"
# shellcheck source=job_scripts/common.sh
source job_scripts/common.sh
course_load_setup "$job_dir/setup.env"
echo "== node $node: $(hostname), python $(command -v python)"
python scripts/tools/launch.py "$@"
