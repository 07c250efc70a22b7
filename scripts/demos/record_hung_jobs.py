"""Record the evidence of notebook 09's exercises: two real hung jobs on this machine (CPU, gloo), each
ended by its own timeout.

    python scripts/demos/record_hung_jobs.py notebooks/hung_jobs

  uneven_3_ranks.pyspy.txt  py-spy dump of every rank of `hangs.py --demo uneven-then-barrier --short-rank 2`
                            with 3 ranks, taken once every rank waited in a collective
  uneven_4_ranks.log        what torchrun printed for `hangs.py --demo uneven --short-rank 2` with 4 ranks

Paths and names of the machine that recorded them become short names (the Python that ran the job: "python";
the course directory: "."; a package's install folder, site-packages or dist-packages, absolute or relative, is
dropped, so torch's files read torch/distributed/...; Python's own library folder too; the hosts that the
pre-flight line and torchrun's summary name: HOST), so that the files say nothing about where they were made: the
recorder refuses to write a file that still holds a path of this machine. Run it again after changing
scripts/demos/hangs.py, scripts/demos/runner.py or scripts/machinery/cli.py: the exercises' checks read line
numbers from these files (tests/test_stored_notebooks.py checks every course frame against the source).
"""
import re
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

from kit.output_paths import REPO
from notebook_support import rank_stacks

PYTHON_HEADER = re.compile(r"^(Python v\S+) \(.*\)$", re.M)
# Whatever leads up to an install folder, as torch's log lines name it (relative to the first folder on sys.path
# that holds it: the course directory when a venv lies inside it) or as a traceback does (absolute).
INSTALL_FOLDER = re.compile(r"(?<![\w./:+-])/?(?:[\w.+-]+/)+(?:site|dist)-packages/")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s]+\S*")  # https://pytorch.org/docs/...; file:///home/... is not one
ABSOLUTE_PATH = re.compile(r"(?<![\w.])/+(?:[\w.-]+/)+[\w.-]+")
PRE_FLIGHT_LINE = re.compile(r"^pre-flight all_reduce ok: .*$", re.M)  # "... node(s): vm [0-1], gpu7 [2-3]"


def without_machine_paths(text):
    text = INSTALL_FOLDER.sub("", text)
    for long, name in [(sys.executable, "python"), (sysconfig.get_paths()["stdlib"] + "/", ""),
                       (str(REPO) + "/", ""), (str(REPO), ".")]:
        text = text.replace(long, name)
    text = PRE_FLIGHT_LINE.sub(lambda line: re.sub(r"\S+(?= \[)", "HOST", line[0]), text)
    text = re.sub(r"^(\s*host\s*: ).+$", r"\1HOST", text, flags=re.M)  # torchrun's summary of a failure
    text = PYTHON_HEADER.sub(r"\1", text)
    left = ABSOLUTE_PATH.findall(URL.sub("", text))
    if left:
        raise ValueError(f"a path of this machine would be stored: {left}; shorten it in without_machine_paths")
    return text


def without_demo_arguments(dump):
    """py-spy's "Process N: python -u scripts/demos/hangs.py --demo ... --short-rank 2 ..." line without the
    demo's arguments: they name the rank that notebook 09's exercise 1 asks for."""
    return re.sub(r"(?m)^(Process \d+: .*?hangs\.py) .*$", r"\1 (its arguments left out)", dump)


def record_dumps(folder):
    def ready(frames):
        waiting = rank_stacks.waiting_collective(frames)
        return waiting is not None and waiting[1].file == "demos/hangs.py"

    texts = {}
    stacks, _, _ = rank_stacks.dump_hung_job("demos/hangs.py", "--demo", "uneven-then-barrier", "--short-rank", 2,
                                             "--timeout", 20, nproc=3, ready=ready, keep_text=texts)
    assert all(ready(frames) for frames in stacks.values()), stacks
    parts = [f"=== rank {rank}: py-spy dump --pid <its pid> ===\n"
             f"{without_demo_arguments(without_machine_paths(texts[rank])).strip()}\n" for rank in sorted(texts)]
    (folder / "uneven_3_ranks.pyspy.txt").write_text("\n".join(parts))


def record_log(folder):
    _, output, status = rank_stacks.dump_hung_job("demos/hangs.py", "--demo", "uneven", "--short-rank", 2,
                                                  "--timeout", 5, nproc=4, ready=lambda frames: True)
    assert status != 0 and "last reported step 2" in output, output
    (folder / "uneven_4_ranks.log").write_text(without_machine_paths(output))


def main(argv=None):
    folder = Path((argv or sys.argv[1:] or ["notebooks/hung_jobs"])[0])
    folder.mkdir(parents=True, exist_ok=True)
    record_dumps(folder)
    record_log(folder)
    print(f"recorded {', '.join(sorted(path.name for path in folder.iterdir()))} in {folder}")


if __name__ == "__main__":
    main()
