"""scripts/launch.py: the torchrun arguments it derives from PBS and Slurm environments,
and the clear one-line errors it gives for a broken one."""
import socket
import subprocess
import sys
import time

import pytest

from cluster_helpers import LAUNCHER, REPO, SHORT_RUN, clean_environment, job_id_with_free_port, load_launcher, read_record

launch = load_launcher()
SCRIPT = "scripts/train_ddp.py"
TORCHRUN = ["python", "-m", "torch.distributed.run"]


@pytest.fixture(autouse=True)
def no_gpus_here(monkeypatch):
    """Whatever this machine has, the launcher sees no GPU unless the environment says so."""
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)


def nodefile(tmp_path, *lines):
    path = tmp_path / "nodefile"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def command_for(env, **options):
    plan = launch.plan_from_env(env, **options)
    return launch.torchrun_command(plan, SCRIPT, ["--epochs", "1"], python="python")


# ---------------------------------------------------------------- PBS

def test_pbs_two_nodes_second_node(tmp_path):
    # PBS lists a host once per chunk or cpu: 8 lines each here, 2 distinct hosts.
    env = {
        "PBS_JOBID": "4242.pbs01", "PBS_NODEFILE": nodefile(tmp_path, *["gpu01"] * 8, *["gpu02"] * 8),
        "PBS_NODENUM": "1", "NGPUS": "2", "NCPUS": "16",
    }
    port = launch.job_port("4242.pbs01")
    assert command_for(env) == TORCHRUN + [
        "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu01:{port}",
        "--rdzv-id=pbs-4242.pbs01", "--rdzv-conf=is_host=0,join_timeout=300", SCRIPT, "--epochs", "1",
    ]


def test_pbs_first_node_hosts_the_rendezvous(tmp_path):
    env = {"PBS_JOBID": "4242.pbs01", "PBS_NODEFILE": nodefile(tmp_path, "gpu01", "gpu02"), "PBS_NODENUM": "0", "NGPUS": "4"}
    command = command_for(env, port=12345)
    assert "--rdzv-endpoint=gpu01:12345" in command
    assert "--rdzv-conf=is_host=1,join_timeout=300" in command
    assert "--nproc-per-node=4" in command


def test_pbs_node_rank_from_the_host_name_without_pbs_nodenum(tmp_path):
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, "elsewhere01", socket.gethostname()), "NGPUS": "1"}
    plan = launch.plan_from_env(env)
    assert (plan.node_rank, plan.nnodes) == (1, 2)


def test_pbs_host_not_in_the_node_file(tmp_path):
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, "elsewhere01", "elsewhere02"), "NGPUS": "1"}
    with pytest.raises(launch.LaunchError, match="not in PBS_NODEFILE.*pbsdsh"):
        launch.plan_from_env(env)


def test_pbs_more_tasks_than_hosts(tmp_path):
    # Two chunks packed onto one host: pbsdsh would start two tasks for one host.
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01", "gpu01", "gpu02"), "PBS_NODENUM": "2"}
    with pytest.raises(launch.LaunchError, match="place=scatter"):
        launch.plan_from_env(env)


def test_pbs_one_node_is_a_standalone_torchrun(tmp_path):
    env = {"PBS_JOBID": "8.srv", "PBS_NODEFILE": nodefile(tmp_path, *["gpu05"] * 8), "NGPUS": "4", "NCPUS": "32"}
    assert command_for(env) == TORCHRUN + ["--standalone", "--nnodes=1", "--nproc-per-node=4", SCRIPT, "--epochs", "1"]


@pytest.mark.parametrize("ncpus, expected", [("16", 4), ("2", 2), ("1", 1)])
def test_pbs_cpu_node_one_process_per_cpu_up_to_four(tmp_path, ncpus, expected):
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "cpu01"), "NCPUS": ncpus}
    assert f"--nproc-per-node={expected}" in command_for(env)


def test_explicit_nproc_per_node_wins(tmp_path):
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NGPUS": "4"}
    assert "--nproc-per-node=1" in command_for(env, nproc_per_node=1)


def test_pbs_missing_or_empty_node_file(tmp_path):
    with pytest.raises(launch.LaunchError, match="PBS_NODEFILE is not set"):
        launch.plan_from_env({"PBS_JOBID": "1.srv"})
    with pytest.raises(launch.LaunchError, match="cannot read PBS_NODEFILE"):
        launch.plan_from_env({"PBS_JOBID": "1.srv", "PBS_NODEFILE": str(tmp_path / "missing")})
    with pytest.raises(launch.LaunchError, match="is empty"):
        launch.plan_from_env({"PBS_JOBID": "1.srv", "PBS_NODEFILE": nodefile(tmp_path, "", "  ")})


# ---------------------------------------------------------------- Slurm

SLURM_STEP = {  # what srun --ntasks-per-node=1 sets on the second of two nodes
    "SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "32",
}


def test_slurm_two_nodes():
    port = launch.job_port("777")
    assert command_for(SLURM_STEP) == TORCHRUN + [
        "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu07:{port}",
        "--rdzv-id=slurm-777", "--rdzv-conf=is_host=0,join_timeout=300", SCRIPT, "--epochs", "1",
    ]


def test_slurm_cpu_node():
    env = {**SLURM_STEP, "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "3"}
    del env["SLURM_GPUS_ON_NODE"]
    command = command_for(env)
    assert "--nproc-per-node=3" in command and "--rdzv-conf=is_host=1,join_timeout=300" in command


def test_slurm_one_node_in_the_batch_script():
    env = {"SLURM_JOB_ID": "778", "SLURM_JOB_NODELIST": "gpu03", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2"}
    assert command_for(env) == TORCHRUN + ["--standalone", "--nnodes=1", "--nproc-per-node=2", SCRIPT, "--epochs", "1"]


def test_slurm_several_nodes_need_srun():
    env = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(launch.LaunchError, match="srun --ntasks-per-node=1"):
        launch.plan_from_env(env)


def test_slurm_one_launcher_per_node():
    with pytest.raises(launch.LaunchError, match="one per node"):
        launch.plan_from_env({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "8"})


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu07", ["gpu07"]),
    ("gpu[07-09]", ["gpu07", "gpu08", "gpu09"]),
    ("gpu[1,3-4],login1", ["gpu1", "gpu3", "gpu4", "login1"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,b", ["a", "b"]),
])
def test_slurm_host_list_without_scontrol(nodelist, hosts):
    assert launch.expand_hostlist(nodelist) == hosts


# ---------------------------------------------------------------- no scheduler, ports

def test_no_scheduler_is_a_standalone_torchrun():
    command = command_for({})
    assert command[:5] == TORCHRUN + ["--standalone", "--nnodes=1"]
    assert command[5] in {f"--nproc-per-node={n}" for n in range(1, launch.CPU_PROCS_CAP + 1)}


def test_the_port_is_tied_to_the_job():
    ports = {launch.job_port(f"{n}.pbs01") for n in range(50)}
    assert launch.job_port("123.pbs01") == launch.job_port("123.pbs01")  # every node computes the same
    assert len(ports) > 45  # two jobs sharing a node rarely meet on one port
    assert all(launch.PORT_BASE <= port < launch.PORT_BASE + launch.PORT_SPAN for port in ports)


# ---------------------------------------------------------------- the command line

def run_launcher(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, str(LAUNCHER), *args], cwd=REPO, env=env or clean_environment(),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *words):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith("launch.py: error:"), result.stderr
    for word in words:
        assert word in lines[-1], result.stderr


def pbs_env(tmp_path, *hosts, **extra):
    env = clean_environment()
    env.update(PBS_JOBID=extra.pop("job_id", "55.srv"), PBS_NODEFILE=nodefile(tmp_path, *hosts), NGPUS="0", NCPUS="2", **extra)
    return env


def test_dry_run_prints_the_command_and_passes_script_arguments_through(tmp_path):
    env = pbs_env(tmp_path, "localhost", "127.0.0.1", PBS_NODENUM="1")
    result = run_launcher("--dry-run", SCRIPT, "--port", "7", "--epochs", "1", env=env)
    assert result.returncode == 0, result.stderr
    assert "-m torch.distributed.run --nnodes=2 --nproc-per-node=2" in result.stdout
    assert result.stdout.strip().endswith(f"{SCRIPT} --port 7 --epochs 1")  # --port after SCRIPT is the script's
    assert "node 1 of 2" in result.stderr


def test_cli_missing_node_file(tmp_path):
    env = clean_environment()
    env.update(PBS_JOBID="56.srv", PBS_NODEFILE=str(tmp_path / "missing"))
    assert_one_line_error(run_launcher("--dry-run", SCRIPT, env=env), "PBS_NODEFILE", "missing")
    del env["PBS_NODEFILE"]
    assert_one_line_error(run_launcher("--dry-run", SCRIPT, env=env), "PBS_NODEFILE is not set")


def test_cli_empty_node_file(tmp_path):
    assert_one_line_error(run_launcher("--dry-run", SCRIPT, env=pbs_env(tmp_path)), "is empty")


def test_cli_no_such_script(tmp_path):
    assert_one_line_error(run_launcher("--dry-run", "scripts/no_such.py", env=pbs_env(tmp_path, "localhost")), "no such training script")


def test_cli_port_taken_fails_at_once_and_names_the_fix(tmp_path):
    job_id = job_id_with_free_port("taken")
    port = launch.job_port(job_id)
    with socket.socket() as squatter:  # another job's rendezvous store, say
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        start = time.monotonic()
        result = run_launcher(SCRIPT, env=pbs_env(tmp_path, "localhost", "127.0.0.1", job_id=job_id, PBS_NODENUM="0"))
    assert_one_line_error(result, f"port {port}", "--port")
    assert time.monotonic() - start < 20


def test_cli_unresolvable_rendezvous_host_fails_at_once(tmp_path):
    env = pbs_env(tmp_path, "no-such-host.invalid", "localhost", PBS_NODENUM="1")
    start = time.monotonic()
    assert_one_line_error(run_launcher(SCRIPT, env=env), "no-such-host.invalid", "does not resolve")
    assert time.monotonic() - start < 20


def test_runs_torchrun_for_real_without_a_scheduler(tmp_path):
    result = run_launcher("--nproc-per-node", "2", SCRIPT, *SHORT_RUN.split(), "--results-dir", str(tmp_path),
                          "--run-name", "standalone", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "single node: torchrun --standalone" in result.stderr
    assert read_record(tmp_path / "standalone.json")["world_size"] == 2
