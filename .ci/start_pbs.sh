#!/bin/bash
# Start a real OpenPBS with two hosts on this machine, for tests/test_pbs.py.
#
#   sudo bash .ci/start_pbs.sh [start|status|stop]       (default: start)
#
# What it sets up (Debian 12, as root):
# - OpenPBS, built from source into /opt/pbs. The source is, in this order: the tarball
#   named by OPENPBS_SOURCE; shared/pbs/openpbs-src-*.tar.gz beside the course checkout
#   (../shared/pbs/); else a clone of the OpenPBS repository at the pinned revision.
#   The built /opt/pbs is also kept as a tarball in the cache folder (COURSE_CI_CACHE,
#   default /var/cache/course-ci), so a later run, even after /opt/pbs is gone, takes
#   seconds. A build takes about 2 minutes on 2 cores.
# - Two hosts in network namespaces, because OpenPBS refuses a host whose name resolves
#   only to 127.0.0.0/8: "pbshead" (10.200.0.1) runs the server, scheduler, comm and a
#   MoM; "pbsnode2" (10.200.0.2) runs a second MoM. Each has its own host name (UTS
#   namespace). They share this machine's file system, as cluster nodes share /home.
# - The GPU resource ngpus, as GPU sites define it, with 4 on each host that do not exist:
#   the jobs run with their GPU request as shipped (and torch sees no GPU).
# - A job user, "pbsuser" (PBS refuses jobs from root), with a login shell.
# - A Python environment every user can read: a virtual environment made from Debian's
#   /usr/bin/python3 with requirements.txt, in the cache folder. (A Python installed in
#   root's home, such as pyenv's, cannot be run by another user.) The tests link a copy
#   of the course to it as its .venv, as a user's course copy would have one.
# - Lmod from Debian, the module system the tests load a module with.
#
# It writes /var/lib/course-pbs/env (the facts the tests need) and two commands:
#   /var/lib/course-pbs/bin/pbs-root CMD...      a PBS client command as root, on pbshead
#   /var/lib/course-pbs/bin/pbs-user 'CMD'       a command line as pbsuser (login shell), on pbshead
# for example:  /var/lib/course-pbs/bin/pbs-user 'qstat -B; pbsnodes -aS'
#
# Idempotent: what already runs is left running; a second call only checks. If PBS
# cannot be installed, the reason goes to /var/lib/course-pbs/not-installed, and the
# PBS tests skip with it. It touches no PBS it did not install.
set -euo pipefail

ACTION=${1:-start}
REPO=$(cd "$(dirname "$0")/.." && pwd)
STATE=/var/lib/course-pbs
CACHE=${COURSE_CI_CACHE:-/var/cache/course-ci}
PREFIX=/opt/pbs
MARKER=$PREFIX/.installed-by-course-ci
PBS_GIT_URL=https://github.com/openpbs/openpbs.git
PBS_GIT_REV=cd7ab5eda   # the revision of the tarball in shared/pbs/
HEAD=pbshead HEAD_IP=10.200.0.1
NODE2=pbsnode2 NODE2_IP=10.200.0.2
UTS=/run/pbs-uts
NODE2_CONF=/etc/pbs_node2.conf
NODE2_HOME=/var/spool/pbs_node2
JOB_USER=pbsuser
# GPUs each host advertises: 2 for a job's two ranks per node, twice that so two such jobs share a host.
GPUS_PER_HOST=4
JOB_PYTHON=${COURSE_JOB_PYTHON:-/usr/bin/python3}
# A clean PATH: a pyenv or venv python first on PATH would be picked up by configure.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8

START=$SECONDS
say() { echo "start_pbs [+$((SECONDS - START))s]: $*"; }
die() { echo "start_pbs: error: $*" >&2; exit 1; }
not_installed() {  # PBS cannot be installed here: say why, for the tests to report
    mkdir -p "$STATE"
    echo "$*" > "$STATE/not-installed"
    die "$*"
}
in_ns() { local ns=$1; shift; nsenter --net="/run/netns/$ns" --uts="$UTS/$ns" "$@"; }
on_head() { in_ns "$HEAD" env -i PATH="$PREFIX/bin:$PREFIX/sbin:$PATH" LANG=C.UTF-8 "$@"; }

BUILD_DEPS="gcc g++ make libtool autoconf automake pkg-config libhwloc-dev libx11-dev libxt-dev
  libedit-dev libical-dev libncurses-dev perl postgresql-server-dev-all python3-dev tcl-dev tk-dev
  swig libexpat1-dev libssl-dev libxext-dev libxft-dev libcjson-dev git"
RUN_DEPS="expat libedit2 postgresql postgresql-contrib python3 python3-venv tcl tk libical3 libcjson1
  libhwloc15 sudo iproute2 util-linux procps lmod"

# ---------------------------------------------------------------- packages
install_packages() {
    local wanted=$RUN_DEPS missing=() package
    [[ -f $MARKER || -n $(cached_build) ]] || wanted="$wanted $BUILD_DEPS"
    for package in $wanted; do
        [[ $(dpkg-query -W -f='${Status}' "$package" 2>/dev/null) == "install ok installed" ]] || missing+=("$package")
    done
    ((${#missing[@]})) || return 0
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || true
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
        not_installed "apt-get could not install: ${missing[*]}"
}

# ---------------------------------------------------------------- OpenPBS itself
cached_build() {
    compgen -G "$CACHE/openpbs-*-$(. /etc/os-release && echo "$ID$VERSION_ID").tar.gz" | head -n 1 || true
}

source_tarball() {
    if [[ -n ${OPENPBS_SOURCE:-} ]]; then
        echo "$OPENPBS_SOURCE"
    else
        compgen -G "$REPO/../shared/pbs/openpbs-src-*.tar.gz" | head -n 1 || true
    fi
}

build_and_install() {
    local src=$CACHE/openpbs-build tarball revision
    tarball=$(source_tarball)
    rm -rf "$src" && mkdir -p "$src"
    if [[ -n $tarball ]]; then
        [[ -f $tarball ]] || not_installed "OPENPBS_SOURCE=$tarball does not exist"
        revision=$(basename "$tarball" .tar.gz)
        revision=${revision#openpbs-src-}
        say "building OpenPBS $revision from $tarball (about 2 minutes)"
        tar -xzf "$tarball" -C "$src" --strip-components=1
    else
        revision=$PBS_GIT_REV
        say "no OpenPBS source tarball beside the checkout; cloning $PBS_GIT_URL at $revision"
        if ! git clone --quiet "$PBS_GIT_URL" "$src" || ! git -C "$src" checkout --quiet "$revision"; then
            not_installed "cannot get the OpenPBS source: no ../shared/pbs/openpbs-src-*.tar.gz and no clone of $PBS_GIT_URL"
        fi
    fi
    local binary
    binary=$CACHE/openpbs-$revision-$(. /etc/os-release && echo "$ID$VERSION_ID").tar.gz
    if [[ -f $binary ]]; then
        say "unpacking the build cached in $binary"
        tar -xzf "$binary" -C /
    else
        (
            cd "$src"
            ./autogen.sh
            ./configure --prefix="$PREFIX" --with-python=/usr
            make -j"$(nproc)"
            make install
        ) > "$CACHE/openpbs-build.log" 2>&1 || not_installed "the OpenPBS build failed; see $CACHE/openpbs-build.log"
        echo "$revision" > "$MARKER"
        tar -czf "$binary" -C / "${PREFIX#/}"
        say "built; cached as $binary"
    fi
    rm -rf "$src"
}

install_pbs() {
    mkdir -p "$CACHE"
    if [[ -x $PREFIX/sbin/pbs_server.bin ]]; then
        [[ -f $MARKER ]] || die "$PREFIX holds a PBS that this script did not install; leaving it alone"
        return 0
    fi
    # No /opt/pbs: a cached build of any revision will do before building again.
    local binary
    binary=$(cached_build)
    if [[ -n $binary ]]; then
        say "unpacking the build cached in $binary"
        tar -xzf "$binary" -C /
    else
        build_and_install
    fi
    # pbs_iff authenticates client commands to the server; it must be setuid root.
    chmod 4755 "$PREFIX/sbin/pbs_iff" "$PREFIX/sbin/pbs_rcp"
}

# ---------------------------------------------------------------- two hosts
make_hosts() {
    local ns
    for ns in $HEAD $NODE2; do
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        ip -n "$ns" link set lo up
    done
    ip -n $HEAD link show veth-head >/dev/null 2>&1 ||
        ip link add veth-head netns $HEAD type veth peer name veth-node2 netns $NODE2
    # (Tests of command output use [[ ]]: `cmd | grep -q` fails under pipefail when grep
    # stops reading early.)
    [[ $(ip -n $HEAD addr show dev veth-head) == *"$HEAD_IP/"* ]] || ip -n $HEAD addr add $HEAD_IP/24 dev veth-head
    [[ $(ip -n $NODE2 addr show dev veth-node2) == *"$NODE2_IP/"* ]] || ip -n $NODE2 addr add $NODE2_IP/24 dev veth-node2
    ip -n $HEAD link set veth-head up
    ip -n $NODE2 link set veth-node2 up
    mkdir -p $UTS
    for ns in $HEAD $NODE2; do  # a UTS namespace kept by a bind mount: the host's own name
        if ! findmnt -n "$UTS/$ns" >/dev/null 2>&1; then
            touch "$UTS/$ns"
            unshare --uts="$UTS/$ns" hostname "$ns"
        fi
    done
    grep -q "^$HEAD_IP $HEAD " /etc/hosts || echo "$HEAD_IP $HEAD # course-pbs" >> /etc/hosts
    grep -q "^$NODE2_IP $NODE2 " /etc/hosts || echo "$NODE2_IP $NODE2 # course-pbs" >> /etc/hosts
}

mom_config() {
    # $clienthost: the server's host may talk to this MoM. $usecp: a job's output files
    # are copied with cp (one file system), not scp.
    echo "\$clienthost $HEAD"
    echo "\$usecp *:/ /"
}

configure_head() {
    if [[ ! -f /etc/pbs.conf || ! -d /var/spool/pbs/mom_priv ]]; then
        say "pbs_postinstall"
        in_ns $HEAD "$PREFIX/libexec/pbs_postinstall" > "$CACHE/openpbs-postinstall.log" 2>&1 || true
    fi
    sed -i -e 's/^PBS_START_MOM=.*/PBS_START_MOM=1/' -e "s/^PBS_SERVER=.*/PBS_SERVER=$HEAD/" /etc/pbs.conf
    mom_config > /var/spool/pbs/mom_priv/config
}

start_head() {
    if on_head qstat -B >/dev/null 2>&1; then
        say "server, scheduler, comm and MoM already running on $HEAD"
        return 0
    fi
    say "starting server, scheduler, comm and MoM on $HEAD"
    on_head /etc/init.d/pbs start 2>&1 | grep -v -e 'ulimit:' -e 'OOM killer' -e 'cannot stat' || true
    for _ in $(seq 60); do on_head qstat -B >/dev/null 2>&1 && break; sleep 1; done
    on_head qstat -B >/dev/null || die "the PBS server did not start; see /var/spool/pbs/server_logs/"
}

start_node2() {
    local home=$NODE2_HOME
    cat > $NODE2_CONF <<EOF
PBS_SERVER=$HEAD
PBS_START_SERVER=0
PBS_START_SCHED=0
PBS_START_COMM=0
PBS_START_MOM=1
PBS_EXEC=$PREFIX
PBS_HOME=$home
PBS_CORE_LIMIT=unlimited
PBS_SCP=/usr/bin/scp
PBS_LEAF_ROUTERS=$HEAD
PBS_TMPDIR=/var/tmp/pbs_node2
EOF
    install -d -m 0755 $home $home/aux $home/mom_logs
    install -d -m 0700 $home/checkpoint
    install -d -m 0751 $home/mom_priv $home/mom_priv/jobs
    install -d -m 0750 $home/mom_priv/hooks $home/mom_priv/hooks/tmp
    install -d -m 1777 $home/spool $home/undelivered /var/tmp/pbs_node2
    [[ -f $home/pbs_environment ]] || cp -p /var/spool/pbs/pbs_environment $home/
    mom_config > $home/mom_priv/config
    if [[ -f $home/mom_priv/mom.lock ]] && kill -0 "$(cat $home/mom_priv/mom.lock)" 2>/dev/null; then
        say "second MoM already running on $NODE2"
    else
        say "starting the second MoM on $NODE2"
        in_ns $NODE2 env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PBS_CONF_FILE=$NODE2_CONF "$PREFIX/sbin/pbs_mom"
    fi
    on_head qmgr -c "list node $NODE2" >/dev/null 2>&1 || on_head qmgr -c "create node $NODE2"
}

configure_server() {
    # Finished jobs stay visible to qstat -x (the tests read their exit status and record).
    on_head qmgr -c "set server job_history_enable = True"
    # OpenPBS's default; the walltime chain test pauses it while it starts a job where it chooses (qrun -H),
    # and a test cut short in between leaves it off.
    on_head qmgr -c "set server scheduling = True"
    for _ in $(seq 60); do
        (($(on_head pbsnodes -a | grep -c 'state = free') >= 2)) && { advertise_gpus; return 0; }
        sleep 1
    done
    on_head pbsnodes -a
    die "the two PBS nodes did not become free; see /var/spool/pbs/mom_logs/ and $NODE2_HOME/mom_logs/"
}

# GPUs that do not exist, so that the jobs run with their GPU request as shipped: the resource
# ngpus, as GPU sites define it (a consumable host-level count the scheduler allocates, hence
# its place in sched_config's resources line), and GPUS_PER_HOST of it on each host. Torch
# sees none: the tests submit with COURSE_CPU_FALLBACK=yes, or check the job stops without.
advertise_gpus() {
    local conf=/var/spool/pbs/sched_priv/sched_config lock=/var/spool/pbs/sched_priv/sched.lock host
    on_head qmgr -c "list resource ngpus" >/dev/null 2>&1 || on_head qmgr -c "create resource ngpus type=long, flag=nh"
    if ! grep -qE '^resources:.*\bngpus\b' $conf; then
        sed -i -E 's/^(resources: ".*)"/\1, ngpus"/' $conf
        # The scheduler rereads sched_config on SIGHUP.
        if [[ -s $lock ]]; then kill -HUP "$(cat $lock)" 2>/dev/null || true; fi
    fi
    for host in $HEAD $NODE2; do
        on_head qmgr -c "set node $host resources_available.ngpus = $GPUS_PER_HOST"
    done
    say "advertised ngpus=$GPUS_PER_HOST on $HEAD and $NODE2 (no real GPU)"
}

# ---------------------------------------------------------------- the job user and their Python
make_job_user() {
    id $JOB_USER >/dev/null 2>&1 || useradd --create-home --shell /bin/bash $JOB_USER
}

job_environment() {
    # Keyed by the Python and the requirements: a change to either makes a new one.
    local key venv
    key=$("$JOB_PYTHON" -c 'import sys; print("py%d%d" % sys.version_info[:2])')-$(sha256sum "$REPO/requirements.txt" | cut -c1-12)
    venv=$CACHE/job-venv-$key
    if [[ ! -f $venv/.complete ]]; then
        say "creating the job environment $venv from $JOB_PYTHON and requirements.txt (about 2 minutes)"
        rm -rf "$venv"
        "$JOB_PYTHON" -m venv "$venv"
        "$venv/bin/python" -m pip install -r "$REPO/requirements.txt" > "$CACHE/job-venv-pip.log" 2>&1 ||
            die "pip could not install requirements.txt into $venv; see $CACHE/job-venv-pip.log"
        touch "$venv/.complete"
    fi
    chmod -R a+rX "$venv"
    JOB_VENV=$venv
}

write_state() {
    mkdir -p "$STATE/bin"
    rm -f "$STATE/not-installed"
    cat > "$STATE/bin/pbs-root" <<EOF
#!/bin/sh
# A PBS client command as root, on the PBS head host: pbs-root qstat -B
exec nsenter --net=/run/netns/$HEAD --uts=$UTS/$HEAD env PATH=$PREFIX/bin:$PREFIX/sbin:\$PATH "\$@"
EOF
    cat > "$STATE/bin/pbs-user" <<EOF
#!/bin/sh
# A command line as $JOB_USER (login shell), on the PBS head host: pbs-user 'cd DIR && qsub job.pbs'
exec nsenter --net=/run/netns/$HEAD --uts=$UTS/$HEAD runuser -l $JOB_USER -c "\$*"
EOF
    chmod 755 "$STATE/bin/pbs-root" "$STATE/bin/pbs-user"
    cat > "$STATE/env" <<EOF
# Written by .ci/start_pbs.sh; read by tests/test_pbs.py.
PBS_EXEC=$PREFIX
PBS_HOSTS=$HEAD $NODE2
PBS_JOB_USER=$JOB_USER
PBS_JOB_HOME=$(getent passwd $JOB_USER | cut -d: -f6)
PBS_JOB_VENV=$JOB_VENV
PBS_ROOT_COMMAND=$STATE/bin/pbs-root
PBS_USER_COMMAND=$STATE/bin/pbs-user
EOF
}

# ---------------------------------------------------------------- stop
stop_all() {
    local lock=$NODE2_HOME/mom_priv/mom.lock
    if [[ -f $lock ]] && kill -0 "$(cat $lock)" 2>/dev/null; then
        say "stopping the second MoM"
        kill "$(cat $lock)"
    fi
    if [[ -e /run/netns/$HEAD && -x /etc/init.d/pbs ]]; then
        say "stopping the daemons on $HEAD"
        on_head /etc/init.d/pbs stop || true
    fi
    local ns
    for ns in $HEAD $NODE2; do
        if findmnt -n "$UTS/$ns" >/dev/null 2>&1; then umount "$UTS/$ns"; fi
        rm -f "$UTS/$ns"
        if [[ -e /run/netns/$ns ]]; then ip netns del "$ns"; fi
    done
    sed -i '/# course-pbs$/d' /etc/hosts
    say "stopped"
}

[[ $(id -u) == 0 ]] || die "run as root (sudo bash .ci/start_pbs.sh): it installs packages and starts daemons"
case $ACTION in
    start)
        [[ -r /etc/debian_version ]] || not_installed "this script sets up OpenPBS on Debian only"
        install_packages
        install_pbs
        make_hosts
        configure_head
        start_head
        start_node2
        configure_server
        make_job_user
        job_environment
        write_state
        say "OpenPBS is up:"
        on_head pbsnodes -aS
        ;;
    status)
        on_head qstat -B
        on_head pbsnodes -aS
        ;;
    stop) stop_all ;;
    *) die "usage: start_pbs.sh [start|status|stop]" ;;
esac
