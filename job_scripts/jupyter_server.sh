# shellcheck shell=bash
# JupyterLab for the JupyterLab jobs (jupyter.pbs, jupyter.sbatch): on this node, at the course
# directory, reached from your own computer through an SSH tunnel. Sourced after common.sh.

# A free TCP port on HOST (the address the server will listen on).
course_free_port() {
    python - "$1" <<'PY'
import socket
import sys

with socket.socket() as probe:
    probe.bind((sys.argv[1], 0))
    print(probe.getsockname()[1])
PY
}

# course_jupyter NODE LOGIN: serve JupyterLab on NODE (this node's name) and say how to reach it from
# LOGIN (the host the job was submitted from). Runs until the walltime ends, or until it is shut down.
course_jupyter() {
    local node=$1 login=$2 port kernels
    # GPUs granted that torch cannot see stop the job here, in the launcher's one line, as a training job's would.
    python scripts/tools/launch.py --check-gpus || exit 1
    command -v jupyter >/dev/null ||
        course_fail "no jupyter in the environment set up by job_scripts/site.sh; install the course's requirements there (pip install -r requirements.txt)"
    port=$(course_free_port "$node") || course_fail "cannot listen on $node (does the name resolve here?); set COURSE_JUPYTER_HOST"
    # The token is the password of the server: handed over in the environment, not on the command line
    # (which every user of the node can read with ps), and printed only to this job's log.
    JUPYTER_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(24))')
    export JUPYTER_TOKEN
    # The notebooks ask for the kernel "ddp-course". Register it for this job, pointing at this job's
    # Python, in a folder that goes when the job does; `make kernel` registers it for good.
    kernels=$(mktemp -d "${TMPDIR:-/tmp}/ddp-course-kernel.XXXXXX")
    # shellcheck disable=SC2064  # expand now: the folder of this job
    trap "rm -rf '$kernels'" EXIT
    trap 'exit 143' TERM  # cancelled: leave through the EXIT trap above
    export JUPYTER_PATH="$kernels/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
    python -m ipykernel install --prefix "$kernels" --name ddp-course --display-name "Python (ddp-course)" >/dev/null ||
        course_fail "could not register the ddp-course kernel; is ipykernel installed in the course's environment?"
    local as_root=()
    [[ $(id -u) != 0 ]] || as_root=(--allow-root)  # a container or a test machine; never on a cluster
    cat <<TEXT
== JupyterLab on $node, port $port, serving $PWD
== 1. On your own computer, open a tunnel through the login node (leave it running):
       ssh -N -L $port:$node:$port ${USER:-$(id -un)}@$login
== 2. Then open in your browser:
       http://localhost:$port/lab?token=$JUPYTER_TOKEN
== (The token is the server's password: keep this log to yourself.) Stop the server with File > Shut Down,
== or cancel the job. The notebooks' torchrun cells run on this node, with this job's GPUs.
TEXT
    course_run jupyter lab --no-browser --ip="$node" --port="$port" --ServerApp.port_retries=0 \
        --ServerApp.root_dir="$PWD" --ServerApp.shutdown_no_activity_timeout="${COURSE_JUPYTER_IDLE_SECONDS:-0}" "${as_root[@]}"
}
