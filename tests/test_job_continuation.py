"""How a job continues after its run stopped early, without a scheduler: job_scripts/common.sh's course_train
and course_continue under bash, and scripts/tools/resubmit.py, with stand-ins for qstat, qsub and scontrol
(written into the test's folder) that record what they were asked. tests/test_pbs.py and tests/test_slurm.py
run the same on a real OpenPBS and Slurm.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from cluster_helpers import REPO, clean_environment


def load_resubmit():
    spec = importlib.util.spec_from_file_location("course_resubmit", REPO / "scripts" / "tools" / "resubmit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


resubmit = load_resubmit()

# A job as `qstat -f -F json` shows it (OpenPBS 23.06, the attributes the follow-up reads), submitted with
#   qsub -q workq -l select=1:ncpus=1:mem=2gb -l walltime=00:02:00 -A proj -o logs/walltime.log \
#        -v "COURSE_ARGS=--epochs 2 --run-name x,NCCL_SOCKET_IFNAME='ib0,ib1'" job_scripts/04_ddp.pbs
JOB = {
    "Job_Name": "walltime", "queue": "workq", "Account_Name": "proj", "project": "_pbs_project_default",
    "Resource_List": {"mem": "2gb", "ncpus": 1, "nodect": 1, "place": "free", "select": "1:ncpus=1:mem=2gb",
                      "walltime": "00:02:00"},
    "Output_Path": "login1:/home/u/course/logs/walltime.log", "Error_Path": "login1:/home/u/course/walltime.e89",
    "Join_Path": "oe",
    "Variable_List": {"PBS_O_HOME": "/home/u", "PBS_O_WORKDIR": "/home/u/course", "PBS_O_QUEUE": "workq",
                      "COURSE_ARGS": "--epochs 2 --run-name x", "NCCL_SOCKET_IFNAME": "ib0,ib1"},
    "Submit_arguments": "-q workq -l select=1:ncpus=1:mem=2gb -l walltime=00:02:00 -A proj -o logs/walltime.log "
                        "-v COURSE_ARGS=--epochs 2 --run-name x,NCCL_SOCKET_IFNAME=ib0,ib1 job_scripts/04_ddp.pbs",
}


def test_the_follow_up_asks_for_what_the_job_asked_for_and_resumes_from_its_folder():
    command = resubmit.follow_up_command(JOB, "89.server", "checkpoints/walltime-89.server")
    assert command == [
        "qsub", "-W", "depend=afterany:89.server", "-q", "workq",
        "-l", "select=1:ncpus=1:mem=2gb", "-l", "place=free", "-l", "walltime=00:02:00", "-A", "proj",
        "-N", "walltime", "-j", "oe", "-o", "login1:/home/u/course/logs/walltime.log.part2",
        "-v", "COURSE_ARGS=--epochs 2 --run-name x,NCCL_SOCKET_IFNAME='ib0,ib1',"
              "COURSE_CHECKPOINT_DIR=checkpoints/walltime-89.server,COURSE_JOB_PART=2",
        "job_scripts/04_ddp.pbs"]


def test_the_third_job_of_a_chain_writes_the_third_part_of_the_log():
    second = {**JOB, "Output_Path": "login1:/home/u/course/logs/walltime.log.part2",
              "Variable_List": {**JOB["Variable_List"], "COURSE_JOB_PART": 2}}
    command = resubmit.follow_up_command(second, "90.server", "checkpoints/walltime-89.server")
    assert "login1:/home/u/course/logs/walltime.log.part3" in command and "COURSE_JOB_PART=3" in command[-2]


def test_a_job_with_pbs_default_log_names_leaves_them_to_pbs():
    job = {**JOB, "Output_Path": "login1:/home/u/course/walltime.o89"}
    assert "-o" not in resubmit.follow_up_command(job, "89.server", "checkpoints/x")


# ---------------------------------------------------------------- stand-ins for the schedulers' commands

def stand_ins(folder, qsub_status=0):
    """qstat (prints JOB as JSON, and a walltime), qsub (records its words; fails with QSUB_STATUS) and scontrol
    (records its words) in FOLDER/bin; what they were asked goes to FOLDER/asked."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (folder / "job.json").write_text(json.dumps({"Jobs": {"89.server": JOB}}))
    scripts = {
        "qstat": f'''if [[ "$*" == *"-F json"* ]]; then cat {folder}/job.json
elif [[ $1 == -f ]]; then echo "    Resource_List.walltime = 00:02:00"; fi''',
        "qsub": f'''echo "qsub $*" >> {folder}/asked
if (({qsub_status})); then echo "qsub: Bad UID for job execution" >&2; exit {qsub_status}; fi
echo 90.server''',
        "scontrol": f'''echo "scontrol $*" >> {folder}/asked''',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = clean_environment()
    env["PATH"] = f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    return env


def asked(folder):
    path = folder / "asked"
    return path.read_text().splitlines() if path.exists() else []


def test_resubmit_submits_the_follow_up_and_names_it(tmp_path):
    env = stand_ins(tmp_path)
    env["PBS_JOBID"] = "89.server"
    done = subprocess.run([sys.executable, "scripts/tools/resubmit.py", "checkpoints/walltime-89.server"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("== follow-up: job 90.server continues from checkpoints/walltime-89.server once job "
                                   "89.server has ended (qsub -W depend=afterany:89.server)")
    assert asked(tmp_path)[0].startswith("qsub -W depend=afterany:89.server -q workq -l select=1:ncpus=1:mem=2gb")


def test_a_site_that_refuses_jobs_from_jobs_gets_the_command_to_type(tmp_path):
    env = stand_ins(tmp_path, qsub_status=175)
    env["PBS_JOBID"] = "89.server"
    done = subprocess.run([sys.executable, "scripts/tools/resubmit.py", "checkpoints/walltime-89.server"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert line.startswith("resubmit.py: error: could not submit the follow-up: qsub: Bad UID for job execution; "
                           "to continue by hand once this job has ended, from the course directory on the login "
                           "node: qsub -q workq -l select=1:ncpus=1:mem=2gb"), line
    assert "depend=afterany" not in line and "\n" not in line


# ---------------------------------------------------------------- course_train and course_continue under bash

# A stand-in for the training run: it waits (at most a minute) for a file to appear in its checkpoint folder
# (STOP: the job shell's stop request; GO: the test's go-ahead), if it is given one, and fails if none came;
# then it leaves the note a run leaves when it stopped early (machinery/graceful_stop.py), if it is given
# one, and exits 0.
RUN = '''bash -c 'for _ in $(seq 600); do [[ -z "$1" || -f "$0/$1" ]] && break; sleep 0.1; done
[[ -z "$1" || -f "$0/$1" ]] || exit 1
[[ -z "$2" ]] || echo "$2" > "$0/STOPPED"' "$COURSE_CHECKPOINT_DIR"'''


def job_shell(tmp_path, env, wait_for, note, signal_when_running=None):
    """course_train on RUN in a job shell; SIGNAL_WHEN_RUNNING is sent to the shell once it says it runs, and
    then the run is told to go on (GO)."""
    folder = tmp_path / "checkpoints"
    env = {**env, "COURSE_CHECKPOINT_DIR": str(folder), "COURSE_JOB_START": "0"}
    script = (f"set -euo pipefail; source job_scripts/common.sh; "
              f"course_train {RUN} '{wait_for}' '{note}'; echo '== the job goes on'")
    shell = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in shell.stdout:
        lines.append(line)
        if line.startswith("== running") and signal_when_running:
            shell.send_signal(signal_when_running)
            (folder / "GO").touch()
    shell.wait(timeout=120)
    return shell.returncode, "".join(lines)


def test_slurms_warning_becomes_a_stop_request_and_the_stopped_job_requeues_itself(tmp_path):
    env = stand_ins(tmp_path)
    env["SLURM_JOB_ID"] = "4242"
    status, log = job_shell(tmp_path, env, wait_for="STOP", note="stop-request 7",
                            signal_when_running=signal.SIGUSR1)
    assert status == 0, log
    assert f"== SIGUSR1: the time limit is near; asking the run to stop (touch {tmp_path}/checkpoints/STOP)" in log
    assert "== requeued: job 4242 continues from" in log and asked(tmp_path) == ["scontrol requeue 4242"]


def test_a_finished_run_is_not_continued(tmp_path):
    env = stand_ins(tmp_path)
    env["SLURM_JOB_ID"] = "4242"
    status, log = job_shell(tmp_path, env, wait_for="", note="")
    assert status == 0 and "== the job goes on" in log and asked(tmp_path) == [], log


def test_a_pbs_run_stopped_on_its_budget_submits_its_follow_up(tmp_path):
    env = stand_ins(tmp_path)
    env["PBS_JOBID"] = "89.server"
    status, log = job_shell(tmp_path, env, wait_for="", note="time-budget 7")
    assert status == 0, log
    assert "== follow-up: job 90.server continues from" in log
    assert [line.split()[:3] for line in asked(tmp_path)] == [["qsub", "-W", "depend=afterany:89.server"]]


@pytest.mark.parametrize("note", ["SIGTERM 7", "SIGINT 7"])
def test_a_pbs_run_stopped_by_qdel_before_its_walltime_is_not_continued(tmp_path, note):
    """COURSE_JOB_START=0: the job started long ago, but the stand-in's walltime is 2 minutes, so a SIGTERM now
    would be past it; none came, so the stop was qdel's (or a user's), and nothing follows."""
    env = stand_ins(tmp_path)
    env["PBS_JOBID"] = "89.server"
    status, log = job_shell(tmp_path, env, wait_for="", note=note)
    assert status == 0 and asked(tmp_path) == [], log
    assert f"== stopped at step 7 ({note.split()[0]}), not continued: resubmit with COURSE_CHECKPOINT_DIR=" in log


def test_a_pbs_run_stopped_by_the_walltimes_sigterm_submits_its_follow_up(tmp_path):
    """SIGTERM at the walltime (the job started long ago, COURSE_JOB_START=0, and the walltime is 2 minutes):
    the run stopped on a signal after all, and the job goes on in its follow-up."""
    env = stand_ins(tmp_path)
    env["PBS_JOBID"] = "89.server"
    status, log = job_shell(tmp_path, env, wait_for="GO", note="SIGTERM 7", signal_when_running=signal.SIGTERM)
    assert status == 0, log
    assert "== follow-up: job 90.server continues from" in log and len(asked(tmp_path)) == 1
