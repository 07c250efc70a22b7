"""Record the evidence of notebook 09's exercises: two real hung jobs on this machine (CPU, gloo), each
ended by its own timeout.

    python scripts/demos/record_hung_jobs.py notebooks/hung_jobs

  uneven_3_ranks.pyspy.txt  py-spy dump of every rank of `hangs.py --demo uneven-then-barrier --short-rank 2`
                            with 3 ranks, taken once every rank waited in a collective
  uneven_4_ranks.log        what torchrun printed for `hangs.py --demo uneven --short-rank 2` with 4 ranks

Paths of the machine that recorded them become short names (the Python that ran the job: "python"; the
course directory: "."), so that the files say nothing about where they were made. Run it again after
changing scripts/demos/hangs.py: the exercises' checks read line numbers from these files.
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch

from notebook_support import rank_stacks
from machinery.output_paths import REPO

PYTHON_HEADER = re.compile(r"^(Python v\S+) \(.*\)$", re.M)


def without_machine_paths(text):
    # torch's files as torch/distributed/..., as the notebook's py-spy frames name them: the folder torch is
    # installed in (links resolved or not) is this machine's.
    site_packages = Path(torch.__file__).parent.parent
    for long, name in [(sys.executable, "python"), (str(site_packages) + "/", ""),
                       (str(site_packages.resolve()) + "/", ""), (str(REPO) + "/", ""), (str(REPO), ".")]:
        text = text.replace(long, name)
    return PYTHON_HEADER.sub(r"\1", text)


def record_dumps(folder):
    def ready(frames):
        waiting = rank_stacks.waiting_collective(frames)
        return waiting is not None and waiting[1].file == "demos/hangs.py"

    texts = {}
    stacks, _, _ = rank_stacks.dump_hung_job("demos/hangs.py", "--demo", "uneven-then-barrier", "--short-rank", 2,
                                             "--timeout", 20, nproc=3, ready=ready, keep_text=texts)
    assert all(ready(frames) for frames in stacks.values()), stacks
    parts = [f"=== rank {rank}: py-spy dump --pid <its pid> ===\n{without_machine_paths(texts[rank]).strip()}\n"
             for rank in sorted(texts)]
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
