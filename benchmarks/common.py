"""What every benchmark shares: paths, the hardware a record was measured on, and where records go.

Records are JSON files, one per benchmark run. By default they go to ``results/benchmarks/``
(git-ignored); the ones docs/performance.md quotes are kept in ``benchmarks/results/`` (pass
``--records benchmarks/results``, or ``make benchmark RECORDS=benchmarks/results``).
"""
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
DEFAULT_RECORDS = REPO / "results" / "benchmarks"
COMMITTED_RECORDS = REPO / "benchmarks" / "results"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import torch  # noqa: E402

from lesson import process  # noqa: E402
from machinery import reporting  # noqa: E402

SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text):
    """'1K' -> 1024, '256M' -> 268435456, '4096' -> 4096 (bytes, powers of 2)."""
    unit = SIZE_UNITS.get(text[-1].upper())
    return int(text[:-1]) * unit if unit else int(text)


def format_size(size):
    """268435456 -> '256 MiB'."""
    for unit in ("G", "M", "K"):
        if size >= SIZE_UNITS[unit] and size % SIZE_UNITS[unit] == 0:
            return f"{size // SIZE_UNITS[unit]} {unit}iB"
    return f"{size} B"


# One definition each, shared with the training scripts' records.
usable_cores = process.usable_cpus
cpu_name = reporting.cpu_name


def hardware():
    """The machine and software a number was measured with (no host names, no paths)."""
    info = {
        "cpu": cpu_name(),
        "cpu_cores": usable_cores(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def load_average():
    """The 1-minute load average: other work on the machine while a number was taken."""
    return round(os.getloadavg()[0], 2)


def display_path(path):
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def record_path(records_dir, kind):
    """Where a record of ``kind`` written now goes: ``<records_dir>/<kind>-<date>-<time>.json``."""
    return Path(records_dir) / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_record(records_dir, kind, record, path=None, say=True):
    """Write ``record`` to a new ``record_path`` and, with ``say``, say where. A ``path`` rewrites that record in
    place (gpu_check does after each step), whole or not at all: a process killed while writing leaves the
    record before."""
    path = Path(path or record_path(records_dir, kind))
    path.parent.mkdir(parents=True, exist_ok=True)
    unfinished = path.with_name(path.name + ".writing")
    unfinished.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(unfinished, path)
    if say:
        print(f"record written to {display_path(path)}", flush=True)
    return path


def latest_record(records_dir, kind):
    """The newest record of a kind in a folder, or None."""
    paths = sorted(Path(records_dir).glob(f"{kind}-*.json"))
    return json.loads(paths[-1].read_text()) if paths else None
