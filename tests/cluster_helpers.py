"""Shared by the tests of the launcher and the job scripts, and those that run them on a real PBS or Slurm."""
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB_SCRIPTS = REPO / "job_scripts"
STAND_INS = REPO / "tests" / "cluster_stand_ins"
LAUNCHER = REPO / "scripts" / "tools" / "launch.py"

# Every training run in these tests: one short epoch on the bundled data.
SHORT_RUN = "--epochs 1 --max-steps 5"
# pytest-timeout for the scheduler tests (pyproject.toml gives one test 900 s): a module fixture there waits on a whole
# batch of jobs, which a loaded machine stretches past 900 s while every job moves on. The fixtures' own guards give
# up when no job has changed state for 600 s; this is only the backstop behind them.
BATCH_TIMEOUT = 3600


@functools.cache
def load_launcher():
    """scripts/tools/launch.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("course_launch", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def job_whose_port_is_taken(prefix):
    """A fake job id whose rendezvous port (the launcher derives it from the id) a socket here holds and listens
    on while the block runs, as another job's rendezvous store would. Bound first, then used: no other process
    can take the port in between."""
    job_port = load_launcher().job_port
    for n in range(1000):
        job_id = f"{prefix}{os.getpid()}-{n}.pbs-test"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
            try:
                squatter.bind(("127.0.0.1", job_port(job_id)))
            except OSError:
                continue  # in use already: try the next id
            squatter.listen()
            yield job_id
            return
    raise RuntimeError("no job id whose rendezvous port could be bound here")


def clean_environment():
    """This process's environment without anything a scheduler or a shell function set."""
    drop = ("PBS_", "SLURM_", "SRUN_", "SBATCH_", "BASH_FUNC_", "COURSE_", "TORCHELASTIC_")
    keep = ("COURSE_OUTPUT_DIR",)  # the test session's: runs write their default folders there (conftest.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) or k in keep}
    for name in ("NCPUS", "NGPUS", "VIRTUAL_ENV", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine that has one: the CPU and gloo path
    if not (REPO / ".venv" / "bin" / "activate").exists():
        # site.sh would find no .venv: let it fall through to this interpreter on PATH.
        env.update(COURSE_VENV="", COURSE_CONDA_ENV="")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_job(script, env, cwd, timeout=300):
    """Run a job script under bash, as the scheduler would; output and errors together."""
    return subprocess.run(
        ["bash", str(script)], env=env, cwd=cwd, timeout=timeout,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def read_record(path):
    return json.loads(Path(path).read_text())


def shellcheck():
    return shutil.which("shellcheck")


# ---------------------------------------------------------------- a real OpenPBS (.ci/start_pbs.sh)

PBS_STATE = Path("/var/lib/course-pbs")  # where .ci/start_pbs.sh describes the PBS it started


def pbs_setup():
    """(what .ci/start_pbs.sh wrote about its PBS as a dict, None) or (None, why there is none)."""
    if (PBS_STATE / "not-installed").exists():
        return None, f"OpenPBS could not be installed here: {(PBS_STATE / 'not-installed').read_text().strip()}"
    if not (PBS_STATE / "env").exists():
        return None, "OpenPBS is not set up on this machine; `sudo bash .ci/start_pbs.sh` builds and starts one"
    if os.geteuid() != 0:
        return None, "the test PBS runs in network namespaces that only root can enter; run the tests as root"
    pairs = (line.split("=", 1) for line in (PBS_STATE / "env").read_text().splitlines()
             if "=" in line and not line.startswith("#"))
    return dict(pairs), None


def pbs_as_root(setup, *command, timeout=60):
    """A PBS client command as root, on the PBS head host."""
    return subprocess.run([setup["PBS_ROOT_COMMAND"], *command], capture_output=True, text=True, timeout=timeout)


def pbs_as_user(setup, command_line, timeout=60, stdin=None):
    """A command line as the job user, in a login shell on the PBS head host: a user at the login node."""
    return subprocess.run([setup["PBS_USER_COMMAND"], command_line], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def copy_course_for(user, destination):
    """The course as a user has it: every file git knows, or would add, copied into DESTINATION, owned by USER."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    subprocess.run(["chown", "-R", f"{user}:", str(destination)], check=True)


def wait_for_file(path, seconds=30):
    """A job's output file, once PBS has copied it back (after `qsub -W block=true` returned)."""
    size = -1
    for _ in range(int(seconds * 5)):
        if path.exists() and path.stat().st_size == size:  # there, and no longer growing
            return path.read_text()
        size = path.stat().st_size if path.exists() else -1
        time.sleep(0.2)
    return path.read_text() if path.exists() else None
