"""Copy the figures a fresh run of the notebooks drew into figs/, and say where they came from.

    make figures        # runs every notebook (outputs under results/), then this

The notebooks draw into results/figs/, which git ignores: many figures hold measurements of
the machine that ran them, and a run must not change the checkout. figs/ keeps one reference
copy of each, for the README and the web, changed only by this script. It writes
figs/README.md: each figure, the notebook that draws it, and the machine it was drawn on.
"""
import datetime
import json
import os
import platform
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from core.reporting import cpu_name  # noqa: E402

DRAWN = REPO / "results" / "figs"
FIGS = REPO / "figs"
SAVED = re.compile(r"save_figure\(\s*\w+\s*,\s*\"([^\"]+\.png)\"")


def drawn_by():
    """{figure file name: notebook} from the save_figure calls in the notebooks."""
    owners = {}
    for path in sorted((REPO / "notebooks").glob("[0-9]*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            for name in SAVED.findall("".join(cell["source"])):
                owners[name] = path.name
    return owners


def machine():
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return (f"{cpu_name()}, {os.cpu_count()} cores, {', '.join(gpus) if gpus else 'no GPU'}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def main():
    owners = drawn_by()
    missing = sorted(name for name in owners if not (DRAWN / name).is_file())
    if missing:
        sys.exit(f"error: {', '.join(missing)} not in {DRAWN.relative_to(REPO)}; run `make figures` (it runs the notebooks first)")
    FIGS.mkdir(exist_ok=True)
    lines = ["# figs/", "",
             "Reference copies of the figures the notebooks draw. A run of a notebook draws into `results/figs/`,",
             "which git ignores; these copies change only with `make figures`, which runs every notebook and copies",
             "what they drew here. The measured ones (timings, losses, differences) hold the numbers of the machine",
             "below; yours will differ.", "",
             f"Drawn on {datetime.date.today():%Y-%m-%d}: {machine()}.", "",
             "| figure | drawn by |", "|---|---|"]
    for name, notebook in sorted(owners.items(), key=lambda item: (item[1], item[0])):
        shutil.copyfile(DRAWN / name, FIGS / name)
        lines.append(f"| [{name}]({name}) | [{notebook}](../notebooks/{notebook}) |")
    (FIGS / "README.md").write_text("\n".join(lines) + "\n")
    print(f"copied {len(owners)} figures to figs/ and described them in figs/README.md")


if __name__ == "__main__":
    main()
