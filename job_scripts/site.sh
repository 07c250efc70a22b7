# shellcheck shell=bash
# Site settings for every job script in job_scripts/: the ONE file to edit when you
# take the course to another cluster. The other site-specific things are the resource
# lines of each job (see "For your site" below).
#
# Each setting below is a default: a value already in the environment wins, so you can
# also pass one at submission (qsub -v COURSE_CONDA_ENV=myenv ...; sbatch passes your
# environment on by itself).

# ============================ EDIT HERE FOR YOUR SITE ============================

# Modules to load, separated by spaces ("" loads none; `module avail` lists your
# site's), and extra module folders to search first, separated by ':' (`module use`).
# Asking for modules where there is no `module` command is an error.
: "${COURSE_MODULES=}"
: "${COURSE_MODULE_PATH=}"

# The Python environment with torch, the first of these that applies:
#   1. the virtual environment COURSE_VENV, if it exists (relative paths are from the
#      course directory; the README's setup creates .venv there);
#   2. the conda environment named COURSE_CONDA_ENV ("" for none), made from
#      environment.yml on the login node; `conda` must be on PATH in a job: load the
#      module that provides it (COURSE_MODULES), or see docs/running_on_a_cluster.md;
#   3. whatever python is on PATH (a module's, say), when both are "".
# Whichever it is, make it from a Python every compute node can run, on a file system
# every node sees: the multi-node jobs check that each node finds the same python.
: "${COURSE_VENV=.venv}"
: "${COURSE_CONDA_ENV=ddp-course}"

# A job whose run stopped at its time limit continues by itself (docs/running_on_a_cluster.md):
# PBS jobs submit their follow-up with qsub, Slurm jobs requeue themselves. Where jobs may not
# submit jobs (PBS: "qsub: Bad UID for job execution" from a compute node), set "no" and chain
# the jobs from the login node instead, as the guide shows.
: "${COURSE_CONTINUE=yes}"

# The JupyterLab jobs (jupyter.pbs, jupyter.sbatch): stop the server, ending the job and
# freeing its GPUs, after this many seconds with no kernel running and no one using it
# (0: run until the walltime). Jupyter checks once a minute.
: "${COURSE_JUPYTER_IDLE_SECONDS=0}"

# Networking that some sites need for multi-node runs. Uncomment and adapt.
# export NCCL_SOCKET_IFNAME=ib0   # the interface NCCL uses between nodes (`ip addr` lists them)
# export GLOO_SOCKET_IFNAME=ib0   # the same for gloo, the CPU backend
# export NCCL_IB_DISABLE=1        # no InfiniBand (or a broken one): use TCP instead of hanging at init
# export NCCL_DEBUG=INFO          # NCCL reports what it picked: the first thing to try on a hang

# A job granted GPUs that torch cannot see (a CPU-only torch, a driver too old for the
# build, a module not loaded) stops before training, with one line that names the likely
# cause. "yes" runs it on CPUs instead, with the same processes, and its log says so: for a
# site (or a test cluster) that grants GPUs it does not have. Never "yes" on GPU nodes.
: "${COURSE_CPU_FALLBACK:=no}"
export COURSE_CPU_FALLBACK  # read by scripts/tools/launch.py on every node

# For your site, in each job (or on the qsub / sbatch line, which overrides the job):
# every job asks for the GPUs its step needs: Slurm --gres=gpu:N; PBS ngpus in the select
# line, a resource each PBS site defines for itself, often by that name (where qsub answers
# "Unknown resource: ngpus", use your site's name). Where your site asks for more, add it:
#   #PBS -l select=1:ncpus=16:mem=32gb:ngpus=2:gpu_model=a100    a GPU model, if it has them
#   #PBS -q gpu               a queue, where the default one has no GPUs (Slurm: --partition)
#   #PBS -A my_project        a project or account to charge, where your site asks for one
# A laptop or a site without GPUs overrides the GPU request at submission (a PBS select
# given on the qsub line replaces the job's whole select):
#   qsub -l select=1:ncpus=4:mem=8gb job_scripts/04_ddp.pbs
#   sbatch --gres=none --partition=<a CPU partition> job_scripts/04_ddp.sbatch

# =================================================================================

# How the settings above are applied. Sites with other habits (e.g. `source activate`,
# a container) change these functions.
site_load_modules() {
    [[ -n $COURSE_MODULES$COURSE_MODULE_PATH ]] || return 0
    site_module_command
    local dir name
    local -a dirs
    IFS=: read -r -a dirs <<<"$COURSE_MODULE_PATH"
    for dir in "${dirs[@]}"; do
        [[ -z $dir ]] || module use "$dir" || course_fail "module use $dir failed; check COURSE_MODULE_PATH in job_scripts/site.sh"
    done
    for name in $COURSE_MODULES; do
        module load "$name" || course_fail "module load $name failed; set COURSE_MODULES in job_scripts/site.sh ('module avail' lists them)"
    done
}

# `module` is a shell function that a login shell defines. Where it is missing (a shell
# that is not a login shell), the module system's own start-up file defines it.
site_module_command() {
    if ! type module >/dev/null 2>&1 && [[ -r ${MODULESHOME:-}/init/bash ]]; then
        # shellcheck source=/dev/null
        source "$MODULESHOME/init/bash"
    fi
    type module >/dev/null 2>&1 ||
        course_fail "modules are asked for (COURSE_MODULES='$COURSE_MODULES') but this shell has no 'module' command; set COURSE_MODULES=\"\" and COURSE_MODULE_PATH=\"\" in job_scripts/site.sh, or ask your site how batch jobs load modules"
}

site_activate_python() {
    if [[ -n $COURSE_VENV && -f $COURSE_VENV/bin/activate ]]; then
        # shellcheck source=/dev/null
        source "$COURSE_VENV/bin/activate"
    elif [[ -n $COURSE_CONDA_ENV ]]; then
        # CONDA_EXE is set where conda was set up in this shell before (conda init, a module).
        local conda=${CONDA_EXE:-conda}
        command -v "$conda" >/dev/null ||
            course_fail "no virtual environment at '$COURSE_VENV' and no conda on PATH to activate '$COURSE_CONDA_ENV'; set COURSE_MODULES (the module that provides conda) / COURSE_VENV / COURSE_CONDA_ENV in job_scripts/site.sh"
        eval "$("$conda" shell.bash hook)"
        conda activate "$COURSE_CONDA_ENV" ||
            course_fail "conda activate $COURSE_CONDA_ENV failed; create it (conda env create -f environment.yml) or set COURSE_CONDA_ENV in job_scripts/site.sh"
    fi
}
