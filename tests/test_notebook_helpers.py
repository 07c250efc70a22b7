"""scripts/notebook_support/runs.py: what a notebook cell gets when a run it starts fails, and where
its figures go."""
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers import REPO  # noqa: E402
from notebook_support import runs as notebook  # noqa: E402


def test_a_failed_run_carries_the_tail_of_its_output_stderr_included():
    script = "import sys\nfor i in range(100): print(f'line {i}')\nprint('the cause', file=sys.stderr)\nsys.exit(3)"
    with pytest.raises(notebook.RunFailed) as failure:
        notebook.run_and_check([sys.executable, "-c", script], "demo.py", timeout=60, echo=False)
    message = str(failure.value)
    assert message.startswith("demo.py exited with status 3; the last lines of its output (stderr included):")
    assert message.endswith("line 99\nthe cause")  # in the order written, stderr included
    assert "line 59" not in message  # only the tail: a notebook cell stays readable
    assert failure.value.status.endswith("3") and "line 0\n" in failure.value.output


def test_a_run_past_its_time_limit_says_so_with_what_it_printed():
    script = "import time\nprint('started', flush=True)\ntime.sleep(60)"
    with pytest.raises(notebook.RunFailed) as failure:
        notebook.run_and_check([sys.executable, "-c", script], "slow.py", timeout=3, echo=False)
    assert "slow.py ran past its 3 s limit" in str(failure.value) and "started" in str(failure.value)


def test_torchruns_banner_is_dropped():
    banner = "\n*****\nSetting OMP_NUM_THREADS environment variable for each process to be 1\n*****\nreal output\n"
    assert notebook.strip_launcher_banner(banner) == "real output\n"


def test_child_stderr_catches_what_child_processes_write():
    with notebook.child_stderr() as lines:
        subprocess.run([sys.executable, "-c", "import sys; print('from the child', file=sys.stderr)"], timeout=60)
    assert lines == ["from the child"]


def test_figures_go_where_git_does_not_look(tmp_path, monkeypatch, capsys):
    assert notebook.FIGURES == notebook.OUTPUT / "results" / "figs"  # OUTPUT: tests/test_output_folder.py
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/figs/any.png"], cwd=REPO)
    assert ignored.returncode == 0, "results/figs/ must be git-ignored"
    monkeypatch.setattr(notebook, "FIGURES", tmp_path / "figs")
    monkeypatch.setenv("COURSE_OUTPUT_DIR", str(tmp_path))
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    notebook.save_figure(fig, "line.png")
    assert (tmp_path / "figs" / "line.png").read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().out == "saved figs/line.png\n"


def test_notebooks_draw_only_through_save_figure():
    for path in sorted((REPO / "notebooks").glob("[0-9]*.ipynb")):
        text = path.read_text()
        assert ".savefig(" not in text, f"{path.name} saves a figure itself; use notebook_support.runs.save_figure"


def test_every_reference_figure_has_a_notebook_or_the_benchmarks_that_draw_it():
    sys.path.insert(0, str(REPO / "notebooks"))
    try:
        import reference_figures
    finally:
        sys.path.pop(0)
    drawn = reference_figures.drawn_by()
    by_benchmarks = set(re.findall(r'^\s*save\(.*"([\w.-]+\.png)"\)$', (REPO / "benchmarks" / "plots.py").read_text(),
                                   re.M))
    committed = {path.name for path in (REPO / "figs").glob("*.png")}
    assert by_benchmarks and committed <= set(drawn) | by_benchmarks, (
        f"figures in figs/ that no notebook and no benchmark draws: {sorted(committed - set(drawn) - by_benchmarks)}")
    readme = (REPO / "figs" / "README.md").read_text()
    assert all(f"[{name}]({name})" in readme for name in committed)
    reference_figures.stamp_rows(readme, sorted(drawn), "today")  # `make figures` finds a row for each


def test_make_figures_stamps_measured_rows_and_leaves_the_rest():
    sys.path.insert(0, str(REPO / "notebooks"))
    try:
        import reference_figures
    finally:
        sys.path.pop(0)
    readme = "\n".join([
        "| figure | what it shows | drawn by | drawn on |", "|---|---|---|---|",
        "| [a.png](a.png) | a diagram | 00 | diagram |",
        "| [b.png](b.png) | timings | 01 | 2020-01-01: old machine |",
        "| [bench.png](bench.png) | a benchmark | make benchmark | 2020-01-01: old machine |"]) + "\n"
    stamped = reference_figures.stamp_rows(readme, ["a.png", "b.png"], "2030-01-01: new machine").splitlines()
    assert stamped[2] == "| [a.png](a.png) | a diagram | 00 | diagram |"
    assert stamped[3] == "| [b.png](b.png) | timings | 01 | 2030-01-01: new machine |"
    assert stamped[4] == "| [bench.png](bench.png) | a benchmark | make benchmark | 2020-01-01: old machine |"
    with pytest.raises(ValueError, match="no row for c.png"):
        reference_figures.stamp_rows(readme, ["c.png"], "today")


TORCHRUN_OUTPUT = """\
device cpu, backend gloo, world size 2, 1 CPU thread(s) per process
fault drill: rank 0 exits with status 3 after step 8
[rank1]:[W1123 11:00:27.892497008 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=9): Failed to recv
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:790 \
(most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f0c5bb5e60d in /x/libc10.so)
<omitting python frames>
frame #18: _start + 0x21 (0x55c9118bb081 in /x/bin/python)

error: rank 1 lost a peer in a collective
W1123 10:55:34.933000 3632 /x/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 3652 \
closing signal SIGTERM
I1123 10:55:34.933000 3632 /x/torch/distributed/elastic/agent/server/api.py:946] [default] Worker group FAILED. \
1/1 attempts left; will restart worker group
resumed from checkpoints/x/checkpoint-00000008.pt: epoch 2, 2 of 63 batches done, step 8
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_script_lines_keep_the_scripts_own_lines_only():
    assert notebook.script_lines(TORCHRUN_OUTPUT) == [
        "device cpu, backend gloo, world size 2, 1 CPU thread(s) per process",
        "fault drill: rank 0 exits with status 3 after step 8",
        "error: rank 1 lost a peer in a collective",
        "resumed from checkpoints/x/checkpoint-00000008.pt: epoch 2, 2 of 63 batches done, step 8"]


def test_launcher_lines_keep_torchruns_messages_without_times_and_pids():
    assert notebook.launcher_lines(TORCHRUN_OUTPUT) == [
        "Sending process 3652 closing signal SIGTERM",
        "[default] Worker group FAILED. 1/1 attempts left; will restart worker group"]
