"""What the stored notebooks hold: their outputs, and nothing that changes from run to run
or machine to machine that the sanitizer does not mask.

- no per-run metadata: nbclient stores `execution` timestamps in every cell unless told not
  to (`make notebooks` tells it: record_timing=False), and each run would change every cell;
- the kernel they ask for is the course's (`make kernel` registers it), in every notebook;
- no output shows a path of the machine that ran it;
- notebook 09's hung-job evidence: the recorder that made it stores no path or host of the machine, and the
  stored py-spy dumps still point at the course's code as it is;
- nbval reads every rule of the sanitizer.
"""
import ast
import re
import sys

import pytest

from helpers import NOTEBOOKS, REPO, SCRIPTS, outputs_text
from helpers import load_notebook as load

PER_RUN_KEYS = ("execution", "ExecuteTime")  # nbclient's timestamps; the older nbextension's


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_no_cell_stores_per_run_metadata(path):
    stored = [(number, key) for number, cell in enumerate(load(path)["cells"])
              for key in PER_RUN_KEYS if key in cell.get("metadata", {})]
    assert not stored, f"{path.name} stores run timestamps in cells {stored}; re-execute it with `make notebooks`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_the_kernel_is_the_courses(path):
    spec = load(path)["metadata"].get("kernelspec", {})
    assert (spec.get("name"), spec.get("display_name")) == ("ddp-course", "Python (ddp-course)"), (
        f"{path.name} asks for the kernel {spec.get('name')!r}; set its metadata.kernelspec to the course's "
        "(name ddp-course, display_name 'Python (ddp-course)'), which `make kernel` registers")


MACHINE_PATHS = re.compile(r"(/home/|/root/|/Users/|/work/|C:\\\\Users)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_no_output_shows_a_path_of_this_machine(path):
    for number, cell in enumerate(load(path)["cells"]):
        text = outputs_text(cell)
        assert str(REPO) not in text and not MACHINE_PATHS.search(text), (
            f"cell {number} of {path.name} shows a machine path: {MACHINE_PATHS.search(text) or str(REPO)}")


def test_the_hung_job_recorder_stores_no_path_or_host_of_this_machine():
    """scripts/demos/record_hung_jobs.py, which made notebook 09's evidence: torch's files read torch/... from any
    install folder (torch's log names it relative to the course directory when the venv lies inside it), the host
    reads HOST, and a path it cannot shorten stops the recording instead of being stored."""
    from demos.record_hung_jobs import without_machine_paths

    recorded = ("W1126 22:05:43.269000 20357 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
                "multiprocessing/api.py:1028] Sending process 20706 closing signal SIGTERM\n"
                '  File "/usr/lib/python3/dist-packages/torch/distributed/run.py", line 1142, in <module>\n'
                f"Process 20706: {sys.executable} -u {REPO}/scripts/demos/hangs.py --demo uneven\n"
                "pre-flight all_reduce ok: 4 rank(s) on 2 node(s): gpu-node-17 [0-1], gpu-node-18 [2-3]\n"
                "  host      : gpu-node-17.cluster.example.org\n"
                "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert without_machine_paths(recorded) == (
        "W1126 22:05:43.269000 20357 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 20706 "
        "closing signal SIGTERM\n"
        '  File "torch/distributed/run.py", line 1142, in <module>\n'
        "Process 20706: python -u scripts/demos/hangs.py --demo uneven\n"
        "pre-flight all_reduce ok: 4 rank(s) on 2 node(s): HOST [0-1], HOST [2-3]\n"
        "  host      : HOST\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert without_machine_paths("an unexpected site-packages/ layout") == "an unexpected site-packages/ layout"
    with pytest.raises(ValueError, match="/home/someone/train.py"):
        without_machine_paths('  File "/home/someone/train.py", line 3, in <module>')


def test_the_stored_dumps_of_notebook_09_match_the_course_as_it_is():
    """Exercise 1 reads line numbers from notebooks/hung_jobs/: each rank's must still be the collective's call in
    demos/hangs.py, and every frame of the course's own code must still name its function (after an edit of
    hangs.py, runner.py or cli.py, run scripts/demos/record_hung_jobs.py again)."""
    from notebook_support import exercises, rank_stacks

    evidence = exercises.hung_job_evidence("uneven_3_ranks.pyspy.txt")
    assert "--short-rank" not in evidence  # the demo's arguments would name the rank the exercise asks for
    dumps = exercises.rank_dumps(evidence)
    waits = exercises.where_each_rank_waits(dumps)
    hangs = (SCRIPTS / "demos" / "hangs.py").read_text().splitlines()
    assert sorted(waits) == [0, 1, 2]
    for rank, (collective, caller) in waits.items():
        assert caller.file == "demos/hangs.py" and f"dist.{collective.function}(" in hangs[caller.line - 1], (
            rank, collective, caller, hangs[caller.line - 1])
    for rank, dump in dumps.items():
        for frame in rank_stacks.main_thread(dump):
            if not frame.file.startswith("torch/"):  # the rest is the course's, named from scripts/
                assert qualified_name_at(SCRIPTS / frame.file, frame.line) == frame.function, (rank, frame)


def qualified_name_at(path, line):
    """The qualified name of the innermost function of ``path`` whose lines hold ``line`` ("<module>" outside
    any), as py-spy names a frame on Python 3.11: "f", "Class.method", "f.<locals>.g"."""
    def inside(node, prefix):
        for child in ast.iter_child_nodes(node):
            if not getattr(child, "lineno", 0) <= line <= getattr(child, "end_lineno", 0):
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return inside(child, f"{prefix}{child.name}.<locals>.") or f"{prefix}{child.name}"
            return inside(child, f"{prefix}{child.name}." if isinstance(child, ast.ClassDef) else prefix)
        return None

    return inside(ast.parse(path.read_text()), "") or "<module>"


def test_nbval_reads_every_rule_of_the_sanitizer():
    from nbval.plugin import get_sanitize_patterns

    rules = (REPO / "notebooks" / "sanitize.cfg").read_text()
    pairs = get_sanitize_patterns(rules)
    # A rule nbval cannot read is silently left out, e.g. an empty replacement whose "replace: " lost its
    # trailing space to an editor.
    assert len(pairs) == len(re.findall(r"^regex:", rules, re.M)) > 0
    assert all(re.compile(regex) for regex, _ in pairs)


# The host names of the machine that recorded the stored outputs (socket.gethostname(), socket.getfqdn()): after
# re-executing the notebooks on another machine, put its names here.
RECORDED_ON = ("vm", "localhost")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_the_stored_outputs_compare_the_same_on_a_machine_of_another_name(path):
    """A participant's machine has its own host name: every output that shows the recording machine's must read the
    same after the sanitizer once that name is replaced, or strict nbval fails there and nowhere else."""
    from nbval.plugin import get_sanitize_patterns  # nbval's own reading of the rules

    pairs = get_sanitize_patterns((REPO / "notebooks" / "sanitize.cfg").read_text())

    def sanitized(text):
        for regex, replace in pairs:
            text = re.sub(regex, replace, text)
        return text

    names = set(RECORDED_ON)
    for number, cell in enumerate(load(path)["cells"]):
        text = outputs_text(cell)
        for name in names:
            elsewhere = re.sub(rf"\b{re.escape(name)}\b", "gpu-node-17.cluster.example.org", text)
            assert sanitized(text) == sanitized(elsewhere), (
                f"cell {number} of {path.name} shows the host name {name!r} where the sanitizer does not mask it")
