"""scripts/tools/launch.py: the torchrun arguments it derives from PBS and Slurm environments,
and the clear one-line errors it gives for a broken one."""
import re
import shlex
import socket
import subprocess
import sys

import pytest

from cluster_helpers import (
    LAUNCHER,
    REPO,
    SHORT_RUN,
    clean_environment,
    job_whose_port_is_taken,
    load_launcher,
    read_record,
)

launch = load_launcher()
SCRIPT = "scripts/step4_ddp.py"
TORCHRUN = ["python", "-m", "torch.distributed.run"]
# torchrun passes these on to the workers, which stop with a checkpoint on SIGTERM, SIGINT and SIGUSR1.
SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@pytest.fixture(autouse=True)
def no_gpus_here(monkeypatch):
    """Whatever this machine has, the launcher sees no GPU and no PBS server unless a test says so."""
    monkeypatch.setattr(launch, "visible_gpus", lambda ask_torch=False: 0)
    monkeypatch.setattr(launch, "pbs_job_gpus", lambda job_id, host: None)


def torch_sees(monkeypatch, gpus):
    """A GPU node: torch sees this many GPUs (it honours CUDA_VISIBLE_DEVICES)."""
    monkeypatch.setattr(launch, "visible_gpus", lambda ask_torch=False: gpus)


def nodefile(tmp_path, *lines):
    path = tmp_path / "nodefile"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def command_for(env, **options):
    plan = launch.plan_from_env(env, **options)
    return launch.torchrun_command(plan, SCRIPT, ["--epochs", "1"], python="python")


# ---------------------------------------------------------------- PBS

def test_pbs_two_nodes_second_node(tmp_path, monkeypatch):
    torch_sees(monkeypatch, 2)
    # PBS lists a host once per chunk or cpu: 8 lines each here, 2 distinct hosts.
    env = {
        "PBS_JOBID": "4242.pbs01", "PBS_NODEFILE": nodefile(tmp_path, *["gpu01"] * 8, *["gpu02"] * 8),
        "PBS_NODENUM": "1", "NGPUS": "2", "NCPUS": "16",
    }
    port = launch.job_port("4242.pbs01")
    assert command_for(env) == TORCHRUN + [
        "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu01:{port}",
        "--rdzv-id=pbs-4242.pbs01", "--rdzv-conf=is_host=0,join_timeout=300", "--max-restarts=3", SIGNALS, SCRIPT,
        "--epochs", "1",
    ]


def test_pbs_first_node_hosts_the_rendezvous(tmp_path, monkeypatch):
    torch_sees(monkeypatch, 4)
    env = {"PBS_JOBID": "4242.pbs01", "PBS_NODEFILE": nodefile(tmp_path, "gpu01", "gpu02"), "PBS_NODENUM": "0",
           "NGPUS": "4"}
    command = command_for(env, port=12345)
    assert "--rdzv-endpoint=gpu01:12345" in command
    assert "--rdzv-conf=is_host=1,join_timeout=300" in command
    assert "--nproc-per-node=4" in command


def test_pbs_node_rank_from_the_host_name_without_pbs_nodenum(tmp_path, monkeypatch):
    torch_sees(monkeypatch, 1)
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


def this_host():
    return socket.gethostname()


def test_pbs_node_rank_is_the_hosts_place_and_pbs_nodenum_must_agree(tmp_path):
    # What a real pbsdsh task sees: PBS_NODENUM is the host's index, PBS_TASKNUM some number.
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, "elsewhere01", this_host()),
           "PBS_NODENUM": "1", "PBS_TASKNUM": "3000002"}
    plan = launch.plan_from_env(env)
    assert (plan.node_rank, plan.nnodes) == (1, 2)
    assert "PBS_NODENUM=1 agrees" in plan.rank_source
    with pytest.raises(launch.LaunchError, match=r"host 1 of PBS_NODEFILE, but PBS_NODENUM=0"):
        launch.plan_from_env({**env, "PBS_NODENUM": "0"})


def test_pbs_two_tasks_on_one_host_are_refused(tmp_path):
    # Two chunks packed on one host: the node file lists it twice, and pbsdsh starts a task per line.
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, this_host(), this_host(), "elsewhere01"),
           "PBS_NODENUM": "0", "PBS_TASKNUM": "2"}
    with pytest.raises(launch.LaunchError,
                       match=rf"lists {this_host()} 2 times, so pbsdsh starts 2 launchers.*place=scatter"):
        launch.plan_from_env(env)
    # The same node file in the job script (task 1) of a one-host job is one node.
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, this_host(), this_host()),
           "PBS_NODENUM": "0", "PBS_TASKNUM": "1"}
    assert launch.plan_from_env(env).nnodes == 1
    with pytest.raises(launch.LaunchError, match="2 times"):
        launch.plan_from_env({**env, "PBS_TASKNUM": "00000003"})


def test_pbs_one_node_is_a_standalone_torchrun(tmp_path, monkeypatch):
    torch_sees(monkeypatch, 4)
    env = {"PBS_JOBID": "8.srv", "PBS_NODEFILE": nodefile(tmp_path, *["gpu05"] * 8), "NGPUS": "4", "NCPUS": "32"}
    assert command_for(env) == TORCHRUN + ["--standalone", "--nnodes=1", "--nproc-per-node=4", "--max-restarts=3",
                                           SIGNALS, SCRIPT, "--epochs", "1"]


@pytest.mark.parametrize("ncpus, expected", [("16", 4), ("2", 2), ("1", 1)])
def test_pbs_cpu_node_one_process_per_cpu_up_to_four(tmp_path, ncpus, expected):
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "cpu01"), "NCPUS": ncpus}
    assert f"--nproc-per-node={expected}" in command_for(env)


def test_explicit_nproc_per_node_wins(tmp_path, monkeypatch):
    torch_sees(monkeypatch, 4)
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NGPUS": "4"}
    assert "--nproc-per-node=1" in command_for(env, nproc_per_node=1)


def test_pbs_missing_or_empty_node_file(tmp_path):
    with pytest.raises(launch.LaunchError, match="PBS_NODEFILE is not set"):
        launch.plan_from_env({"PBS_JOBID": "1.srv"})
    with pytest.raises(launch.LaunchError, match="cannot read PBS_NODEFILE"):
        launch.plan_from_env({"PBS_JOBID": "1.srv", "PBS_NODEFILE": str(tmp_path / "missing")})
    with pytest.raises(launch.LaunchError, match="is empty"):
        launch.plan_from_env({"PBS_JOBID": "1.srv", "PBS_NODEFILE": nodefile(tmp_path, "", "  ")})


# ---------------------------------------------------------------- GPUs: what the job was granted

@pytest.mark.parametrize("value, count", [
    ("0,1", 2), ("3", 1), ("", 0), ("-1", 0), ("GPU-8f2c1e2a-1b2c,GPU-77aa0e1f-9c0d", 2), ("0,-1,1", 1),
    ("MIG-5c3e3a1b-6d1f-5b7a-9a3e-1c2d3e4f5a6b", 1),
])
def test_cuda_visible_devices_counted_as_cuda_reads_it(value, count):
    assert launch.count_cuda_visible_devices(value) == count


def test_gpus_from_cuda_visible_devices_not_from_the_node(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda ask_torch=False: 2)  # torch honours CUDA_VISIBLE_DEVICES
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "CUDA_VISIBLE_DEVICES": "4,5",
           "NCPUS": "16"}
    plan = launch.plan_from_env(env)
    assert plan.nproc_per_node == 2 and "CUDA_VISIBLE_DEVICES=4,5" in plan.nproc_source
    assert not plan.warnings


def test_an_empty_cuda_visible_devices_means_cpus(tmp_path):
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "cpu01"), "CUDA_VISIBLE_DEVICES": "", "NCPUS": "3"}
    plan = launch.plan_from_env(env)
    assert plan.nproc_per_node == 3 and plan.nproc_source.startswith("no GPU (CUDA_VISIBLE_DEVICES=(empty)")


@pytest.mark.parametrize("exec_vnode, hosts, gpus", [
    ("(pbshead:ncpus=2:ngpus=1)+(pbsnode2:ncpus=2:ngpus=2)", {"pbsnode2"}, 2),
    ("(pbshead:ncpus=2:ngpus=1)+(pbsnode2:ncpus=2:ngpus=2)", {"pbshead"}, 1),
    ("(gpu01[0]:ncpus=8:ngpus=1+gpu01[1]:ncpus=8:ngpus=1)+(gpu02[0]:ngpus=2)", {"gpu01"}, 2),
    ("(pbshead:ncpus=2)+(pbsnode2:ncpus=2)", {"pbshead"}, None),  # the site defines no ngpus
    ("(pbshead:ncpus=2:ngpus=1)", {"pbsnode2"}, None),
])
def test_gpus_from_the_jobs_exec_vnode(exec_vnode, hosts, gpus):
    assert launch.exec_vnode_gpus(exec_vnode, hosts) == gpus


def test_gpus_from_the_pbs_jobs_resources(tmp_path, monkeypatch):
    torch_sees(monkeypatch, 2)
    monkeypatch.setattr(launch, "pbs_job_gpus",
                        lambda job_id, host: 2 if (job_id, host) == ("9.srv", "gpu01") else None)
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NCPUS": "16"}
    plan = launch.plan_from_env(env)
    assert plan.nproc_per_node == 2 and "exec_vnode" in plan.nproc_source


def test_a_warning_when_torch_sees_more_gpus_than_granted(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda ask_torch=False: 8)
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NGPUS": "2"}
    plan = launch.plan_from_env(env)
    assert plan.nproc_per_node == 2
    assert len(plan.warnings) == 1 and "torch sees 8 GPUs on this node but the job was granted 2" in plan.warnings[0]


def test_gpus_the_job_does_not_account_for_are_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda ask_torch=False: 4)
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NCPUS": "16"}
    with pytest.raises(launch.LaunchError, match="torch sees 4 GPU.*nothing says how many.*--nproc-per-node N"):
        launch.plan_from_env(env)
    assert launch.plan_from_env(env, nproc_per_node=4).nproc_per_node == 4


def test_without_a_scheduler_every_gpu_in_view_is_used(monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda ask_torch=False: 3)
    assert launch.plan_from_env({}).nproc_per_node == 3


# ---------------------------------------------------------------- GPUs granted that torch cannot see

GRANTED_TWO = {"SLURM_JOB_ID": "31", "SLURM_JOB_NODELIST": "gpu01", "SLURM_GPUS_ON_NODE": "2",
               "SLURM_CPUS_ON_NODE": "8"}


@pytest.mark.parametrize("requested", [None, 1])
def test_granted_gpus_torch_cannot_see_stop_the_job(requested):
    """Whatever the process count, a job granted GPUs never trains on CPUs unasked."""
    with pytest.raises(launch.LaunchError, match=(
            r"^the job was granted 2 GPU\(s\) on gpu01 \(SLURM_GPUS_ON_NODE=2\) but torch sees none: .*"
            r"A site without GPUs: COURSE_CPU_FALLBACK=yes in job_scripts/site.sh, or submit without the GPU request")):
        launch.plan_from_env(GRANTED_TWO, nproc_per_node=requested)


def test_torch_seeing_fewer_gpus_than_granted_stops_the_job(tmp_path, monkeypatch):
    torch_sees(monkeypatch, 1)
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NGPUS": "2"}
    for fallback in ("no", "yes"):  # the fall-back is for no GPU at all, not for a partial view
        partial = r"granted 2 GPU\(s\) on gpu01 \(NGPUS=2\) but torch sees only 1: check `nvidia-smi`"
        with pytest.raises(launch.LaunchError, match=partial + r".*COURSE_CPU_FALLBACK does not apply") as error:
            launch.plan_from_env({**env, "COURSE_CPU_FALLBACK": fallback}, nproc_per_node=1)
        assert "COURSE_CPU_FALLBACK=yes" not in str(error.value)


def test_the_site_may_allow_cpus_instead_and_the_job_says_so(tmp_path):
    env = {**GRANTED_TWO, "COURSE_CPU_FALLBACK": "yes"}
    plan = launch.plan_from_env(env)
    assert plan.nproc_per_node == 2 and plan.nproc_source == "one per GPU granted, on CPUs: SLURM_GPUS_ON_NODE=2"
    assert plan.warnings == ["the job was granted 2 GPU(s) on gpu01 (SLURM_GPUS_ON_NODE=2) but torch sees none: "
                             "running on CPUs, as COURSE_CPU_FALLBACK=yes in job_scripts/site.sh allows"]
    assert launch.plan_from_env(env, gpus_per_process=2).nproc_per_node == 1  # the layout the GPUs would have had
    assert "launch.py: warning: the job was granted 2 GPU(s)" in launch.describe(plan)


def test_the_fall_back_switch_takes_yes_or_no():
    with pytest.raises(launch.LaunchError, match=r"COURSE_CPU_FALLBACK='true': set it to yes or no"):
        launch.plan_from_env({**GRANTED_TWO, "COURSE_CPU_FALLBACK": "true"})


@pytest.mark.parametrize("env", [
    {"CUDA_VISIBLE_DEVICES": "0,1"},  # no scheduler: nothing was granted
    {"SLURM_JOB_ID": "31", "SLURM_JOB_NODELIST": "cpu01", "CUDA_VISIBLE_DEVICES": "0,1"},  # inherited by sbatch
])
def test_a_cuda_visible_devices_torch_does_not_see_is_a_warning_not_a_grant(env):
    plan = launch.plan_from_env(env, nproc_per_node=2)
    assert plan.warnings == ["CUDA_VISIBLE_DEVICES=0,1 names 2 GPU(s) but torch sees none: check `nvidia-smi`"]


def test_a_cuda_visible_devices_the_scheduler_backs_is_a_grant(tmp_path):
    """A PBS site that isolates GPUs (its cgroups hook) sets CUDA_VISIBLE_DEVICES as well as granting ngpus."""
    env = {"PBS_JOBID": "9.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "CUDA_VISIBLE_DEVICES": "0,1",
           "NGPUS": "2"}
    with pytest.raises(launch.LaunchError, match=r"^the job was granted 2 GPU\(s\) on gpu01 \(NGPUS=2\) but torch "
                                                 r"sees none: "):
        launch.plan_from_env(env)


def test_two_gpus_per_process_on_cpus_needs_two_granted_as_on_gpus():
    with pytest.raises(launch.LaunchError, match=r"each process needs 2 GPUs \(--gpus-per-process\) and this node "
                                                 r"was granted 1"):
        launch.plan_from_env({**GRANTED_TWO, "SLURM_GPUS_ON_NODE": "1", "COURSE_CPU_FALLBACK": "yes"},
                             gpus_per_process=2)


def test_a_cuda_visible_devices_that_hides_every_gpu_is_named_as_the_cause():
    assert launch.why_torch_sees_no_gpu({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}).startswith(
        "CUDA_VISIBLE_DEVICES=NoDevFiles hides every GPU")


def test_qstat_from_the_pbs_configuration_where_path_lacks_it(tmp_path, monkeypatch):
    """A pbsdsh task starts with PATH=/bin:/usr/bin: qstat from PBS_EXEC, as /etc/pbs.conf names it."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (tmp_path / "pbs" / "bin").mkdir(parents=True)
    qstat = tmp_path / "pbs" / "bin" / "qstat"
    qstat.write_text("#!/bin/sh\n")
    qstat.chmod(0o755)
    conf = tmp_path / "pbs.conf"
    conf.write_text(f"PBS_SERVER=head\nPBS_EXEC={tmp_path / 'pbs'}\n")
    assert launch.pbs_command("qstat", {"PBS_CONF_FILE": str(conf)}) == str(qstat)
    assert launch.pbs_command("qstat", {"PBS_CONF_FILE": str(tmp_path / "missing")}) is None


def test_the_gpu_check_alone_for_the_jupyterlab_jobs(capsys):
    """A one-node job's shell: SLURMD_NODENAME, no SLURM_JOB_NODELIST needed (srun sets that for steps)."""
    job = {"SLURM_JOB_ID": "31", "SLURMD_NODENAME": "gpu01", "SLURM_GPUS_ON_NODE": "2"}
    assert launch.main(["--check-gpus"], env=job) == 2
    assert capsys.readouterr().err.startswith("launch.py: error: the job was granted 2 GPU(s) on gpu01 ")
    assert launch.main(["--check-gpus"], env={**job, "COURSE_CPU_FALLBACK": "yes"}) == 0
    assert capsys.readouterr().err.startswith("launch.py: warning: the job was granted 2 GPU(s) on gpu01 ")
    assert launch.main(["--check-gpus"], env={"SLURM_JOB_ID": "31"}) == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("cuda, driver_lists_gpus, cause", [
    (None, False, r"this torch \(.*\) is a CPU-only build: install a CUDA build"),
    ("13.0", False, r"this node has no NVIDIA driver loaded \(no .*\): submit to the GPU queue or partition"),
    ("13.0", True, r"this torch is built for CUDA 13.0 and the node's driver cannot run it"),
])
def test_the_stop_names_the_likely_cause(tmp_path, monkeypatch, cuda, driver_lists_gpus, cause):
    import torch
    monkeypatch.setattr(torch.version, "cuda", cuda)
    (tmp_path / "gpus").mkdir()
    if driver_lists_gpus:
        (tmp_path / "gpus" / "0000:3b:00.0").mkdir()
    monkeypatch.setattr(launch, "NVIDIA_GPUS", str(tmp_path / "gpus"))
    assert re.match(cause, launch.why_torch_sees_no_gpu())
    with pytest.raises(launch.LaunchError, match=cause):
        launch.plan_from_env(GRANTED_TWO)


# ---------------------------------------------------------------- Slurm

SLURM_STEP = {  # what srun --ntasks-per-node=1 sets on the second of two nodes
    "SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "32",
}


def test_slurm_two_nodes(monkeypatch):
    torch_sees(monkeypatch, 4)
    port = launch.job_port("777")
    assert command_for(SLURM_STEP) == TORCHRUN + [
        "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu07:{port}",
        "--rdzv-id=slurm-777", "--rdzv-conf=is_host=0,join_timeout=300", "--max-restarts=3", SIGNALS, SCRIPT,
        "--epochs", "1",
    ]


def test_slurm_cpu_node():
    env = {**SLURM_STEP, "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "3"}
    del env["SLURM_GPUS_ON_NODE"]
    command = command_for(env)
    assert "--nproc-per-node=3" in command and "--rdzv-conf=is_host=1,join_timeout=300" in command


def test_slurm_one_node_in_the_batch_script(monkeypatch):
    torch_sees(monkeypatch, 2)
    env = {"SLURM_JOB_ID": "778", "SLURM_JOB_NODELIST": "gpu03", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2"}
    assert command_for(env) == TORCHRUN + ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3",
                                           SIGNALS, SCRIPT, "--epochs", "1"]


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
    assert command[6:] == ["--max-restarts=3", SIGNALS, SCRIPT, "--epochs", "1"]


def test_the_port_is_tied_to_the_job():
    ports = {launch.job_port(f"{n}.pbs01") for n in range(50)}
    assert launch.job_port("123.pbs01") == launch.job_port("123.pbs01")  # every node computes the same
    assert len(ports) > 45  # two jobs sharing a node rarely meet on one port
    assert all(launch.PORT_BASE <= port < launch.PORT_BASE + launch.PORT_SPAN for port in ports)


# ---------------------------------------------------------------- the command line

def run_launcher(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, str(LAUNCHER), *args], cwd=REPO, env=env or clean_environment(),
                          capture_output=True, text=True, timeout=timeout)


def assert_launcher_error(result, *words):
    """launch.py's own argparse-style error: its last line, no traceback (not a training script's line)."""
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith("launch.py: error:"), result.stderr
    for word in words:
        assert word in lines[-1], result.stderr


def pbs_env(tmp_path, *hosts, **extra):
    env = clean_environment()
    env.update(PBS_JOBID=extra.pop("job_id", "55.srv"), PBS_NODEFILE=nodefile(tmp_path, *hosts), NGPUS="0", NCPUS="2",
               **extra)
    return env


def test_dry_run_says_what_it_derived_and_prints_a_command_that_runs(tmp_path):
    env = pbs_env(tmp_path, "node-a", "node-b", PBS_NODENUM="1")
    result = run_launcher("--dry-run", "--max-restarts", "5", SCRIPT, "--port", "7", "--epochs", "1", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "launch.py: PBS job 55.srv"
    assert re.fullmatch(r"  this node +1 of 2 +PBS_NODENUM=1 \(this host, .*, is not named in PBS_NODEFILE\)", lines[2])
    assert re.fullmatch(r"  processes +2 per node +no GPU "
                        r"\(CUDA_VISIBLE_DEVICES=\(empty\), so CPUs: NCPUS=2, at most 4\)", lines[3])
    assert re.fullmatch(r"  restarts +up to 5 +torchrun --max-restarts; a restart continues from the last checkpoint; "
                        r"no --resume: a rerun job starts over", lines[5])
    # The node's place in the list is not its rank: torchrun's c10d rendezvous orders the nodes by host name.
    assert re.fullmatch(r"  ranks +set by torchrun +c10d orders the nodes by host name; "
                        r"the pre-flight line shows each host's ranks", lines[6])
    # The command, over lines joined by backslash-newline as a shell joins them.
    command = shlex.split(result.stdout[result.stdout.index(sys.executable):].replace("\\\n", ""))
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2"]
    assert "--max-restarts=5" in command
    assert command[-5:] == [SCRIPT, "--port", "7", "--epochs", "1"]  # --port after SCRIPT is the script's


def test_cli_missing_node_file(tmp_path):
    env = clean_environment()
    env.update(PBS_JOBID="56.srv", PBS_NODEFILE=str(tmp_path / "missing"))
    assert_launcher_error(run_launcher("--dry-run", SCRIPT, env=env), "PBS_NODEFILE", "missing")
    del env["PBS_NODEFILE"]
    assert_launcher_error(run_launcher("--dry-run", SCRIPT, env=env), "PBS_NODEFILE is not set")


def test_cli_empty_node_file(tmp_path):
    assert_launcher_error(run_launcher("--dry-run", SCRIPT, env=pbs_env(tmp_path)), "is empty")


def test_cli_no_such_script(tmp_path):
    assert_launcher_error(run_launcher("--dry-run", "scripts/no_such.py", env=pbs_env(tmp_path, "localhost")),
                          "no such training script")


def assert_torchrun_never_started(result):
    """The launcher stopped before handing over to torchrun (which would wait up to --join-timeout for the other
    nodes): at once, whatever the machine's load."""
    assert "launch.py: exec " not in result.stderr, result.stderr
    assert "torch.distributed" not in result.stderr, result.stderr


def test_cli_port_taken_fails_at_once_and_names_the_fix(tmp_path):
    with job_whose_port_is_taken("taken") as job_id:  # another job's rendezvous store, say
        result = run_launcher(SCRIPT, env=pbs_env(tmp_path, "localhost", "127.0.0.1", job_id=job_id, PBS_NODENUM="0"))
    assert_launcher_error(result, f"port {launch.job_port(job_id)}", "--port")
    assert_torchrun_never_started(result)


def test_cli_unresolvable_rendezvous_host_fails_at_once(tmp_path):
    env = pbs_env(tmp_path, "no-such-host.invalid", "localhost", PBS_NODENUM="1")
    result = run_launcher(SCRIPT, env=env)
    assert_launcher_error(result, "no-such-host.invalid", "does not resolve")
    assert_torchrun_never_started(result)


@pytest.mark.slow
def test_runs_torchrun_for_real_without_a_scheduler(tmp_path):
    result = run_launcher("--nproc-per-node", "2", SCRIPT, *SHORT_RUN.split(), "--results-dir", str(tmp_path),
                          "--run-name", "standalone", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "one node: torchrun --standalone" in result.stderr
    assert read_record(tmp_path / "standalone.json")["world_size"] == 2


# ---------------------------------------------------------------- DDP with model parallelism: 2 GPUs per process

@pytest.mark.parametrize("gpus, processes", [(4, 2), (2, 1), (5, 2)])
def test_two_gpus_per_process_starts_half_as_many_processes(tmp_path, monkeypatch, gpus, processes):
    torch_sees(monkeypatch, gpus)
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NGPUS": str(gpus)}
    plan = launch.plan_from_env(env, gpus_per_process=2)
    assert plan.nproc_per_node == processes and plan.nproc_source == f"one per 2 GPUs: NGPUS={gpus}"


def test_two_gpus_per_process_with_one_gpu_is_a_clear_error(monkeypatch):
    torch_sees(monkeypatch, 1)
    with pytest.raises(launch.LaunchError,
                       match=r"each process needs 2 GPUs \(--gpus-per-process\) and this node has 1"):
        launch.plan_from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "1"},
                             gpus_per_process=2)


def test_without_gpus_two_gpus_per_process_changes_nothing(tmp_path):
    env = {"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile(tmp_path, "gpu01"), "NGPUS": "0", "NCPUS": "2"}
    assert launch.plan_from_env(env, gpus_per_process=2).nproc_per_node == launch.plan_from_env(env).nproc_per_node == 2
