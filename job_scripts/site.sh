# shellcheck shell=bash
# Site settings for every job script in job_scripts/: the ONE file to edit when you
# take the course to another cluster. The other site-specific things, walltime,
# queue/partition and GPU model, are in the #PBS / #SBATCH lines of each job.
#
# Each setting below is a default: a value already in the environment wins, so you can
# also pass one at submission (qsub -v COURSE_CONDA_ENV=myenv ...; sbatch passes your
# environment on by itself).

# ============================ EDIT HERE FOR YOUR SITE ============================

# Modules to load, separated by spaces ("" loads none). `module avail` lists your
# site's. Where there is no `module` command, this is skipped with a note.
: "${COURSE_MODULES=anaconda3/2022.05-gcc/9.5.0}"

# The Python environment with torch, the first of these that applies:
#   1. the virtual environment COURSE_VENV, if it exists (relative paths are from the
#      course directory; the README's setup creates .venv there);
#   2. the conda environment named COURSE_CONDA_ENV ("" for none), made from
#      environment.yml on the login node;
#   3. whatever python is on PATH.
: "${COURSE_VENV=.venv}"
: "${COURSE_CONDA_ENV=ddp-course}"

# Networking that some sites need for multi-node runs. Uncomment and adapt.
# export NCCL_SOCKET_IFNAME=ib0   # the interface NCCL uses between nodes (`ip addr` lists them)
# export GLOO_SOCKET_IFNAME=ib0   # the same for gloo, the CPU backend
# export NCCL_IB_DISABLE=1        # no InfiniBand (or a broken one): use TCP instead of hanging at init
# export NCCL_DEBUG=INFO          # NCCL reports what it picked: the first thing to try on a hang

# =================================================================================

# How the settings above are applied. Sites with other habits (e.g. `source activate`,
# a container) change these two functions.
site_load_modules() {
    [[ -n $COURSE_MODULES ]] || return 0
    if ! type module >/dev/null 2>&1; then
        echo "== site.sh: no 'module' command on this node; not loading: $COURSE_MODULES"
        return 0
    fi
    local name
    for name in $COURSE_MODULES; do
        module load "$name" || course_fail "module load $name failed; set COURSE_MODULES in job_scripts/site.sh ('module avail' lists them)"
    done
}

site_activate_python() {
    if [[ -n $COURSE_VENV && -f $COURSE_VENV/bin/activate ]]; then
        # shellcheck source=/dev/null
        source "$COURSE_VENV/bin/activate"
    elif [[ -n $COURSE_CONDA_ENV ]]; then
        type conda >/dev/null 2>&1 ||
            course_fail "no virtual environment at '$COURSE_VENV' and no conda to activate '$COURSE_CONDA_ENV'; set COURSE_MODULES / COURSE_VENV / COURSE_CONDA_ENV in job_scripts/site.sh"
        eval "$(conda shell.bash hook)"
        conda activate "$COURSE_CONDA_ENV" ||
            course_fail "conda activate $COURSE_CONDA_ENV failed; create it (conda env create -f environment.yml) or set COURSE_CONDA_ENV in job_scripts/site.sh"
    fi
}
