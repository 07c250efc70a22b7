"""``kill -USR2 PID`` prints every thread's stack of a course script, and the run goes on (machinery/signals.py,
dump_stacks_on_sigusr2): the fallback of notebook 09 for a hung rank where py-spy is refused."""
import signal
import subprocess

from helpers import PYTHON, REPO, SCRIPTS, script_env
from notebook_support import usr2_stacks

# A script as the course's scripts are: its main goes through cli.run, which installs the signal handlers. It
# waits in a blocking read, as a hung rank waits in a collective, until the test writes a line.
SCRIPT = f"""\
import sys
sys.path.insert(0, {str(SCRIPTS)!r})
from machinery import cli


def wait_for_the_test(args):
    print("waiting for the test", flush=True)
    sys.stdin.readline()
    print("done", flush=True)


cli.run(wait_for_the_test, [])
"""


def test_sigusr2_prints_every_threads_stack_and_the_run_goes_on(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(SCRIPT)
    run = subprocess.Popen([PYTHON, script], cwd=REPO, env=script_env(), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = run.stdout.readline()  # the handlers are installed before main prints it
        assert first == "waiting for the test\n", (first, run.communicate(timeout=60))
        run.send_signal(signal.SIGUSR2)
        # The signal is pending before the line arrives: the process handles it before its read returns.
        stdout, stderr = run.communicate("\n", timeout=60)  # a hang guard, not a speed target
    finally:
        run.kill()
        run.wait()
    assert run.returncode == 0 and stdout == "done\n", (run.returncode, stdout, stderr)
    assert "Current thread 0x" in stderr and "(most recent call first):" in stderr, stderr
    # The main thread is inside wait_for_the_test: still finishing its print, or in its read (the line to read is
    # written only after the signal was sent), never past it.
    lines = SCRIPT.splitlines()
    waiting = {lines.index('    print("waiting for the test", flush=True)') + 1,
               lines.index("    sys.stdin.readline()") + 1}
    assert any(f'File "{script}", line {line} in wait_for_the_test' in stderr for line in waiting), stderr
    assert "in arm_alarm_on_sigterm" in stderr, stderr  # and the course's other thread: every thread
    # What notebook 09's cell reads from such a dump: the main thread's stack, innermost first, files shortened.
    (main,) = usr2_stacks.main_stacks(stderr, "waits.py")
    assert (main[0].function, main[0].file, main[0].line in waiting) == ("wait_for_the_test", "waits.py", True), main
    assert main[-1].function == "<module>" and "machinery/cli.py" in {frame.file for frame in main}, main


def test_a_frame_is_named_from_the_course_or_torch_wherever_they_are_installed():
    scripts = f"{SCRIPTS}/"
    assert usr2_stacks.short_file(scripts + "demos/hangs.py") == "demos/hangs.py"
    for install in ("/opt/venv/lib/python3.11/site-packages", "/usr/lib/python3/dist-packages", "/src/pytorch"):
        assert usr2_stacks.short_file(f"{install}/torch/distributed/distributed_c10d.py") == (
            "torch/distributed/distributed_c10d.py")
    assert usr2_stacks.short_file("/home/someone/train.py") == "train.py"
