"""Copy the figures a fresh run of the notebooks drew into figs/, and say where they came from.

    make figures        # runs every notebook (outputs under results/), then this

The notebooks draw into results/figs/, which git ignores: many figures hold measurements of
the machine that ran them, and a run must not change the checkout. figs/ keeps one reference
copy of each, for the README and the web, changed only by this script. figs/README.md has
one row per figure (what it shows, who draws it, the machine it was drawn on); this script
stamps the rows of the measured figures it copied with this machine, and leaves other rows
(diagrams, figures drawn by other targets) as they are.
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

from machinery.reporting import cpu_name  # noqa: E402

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
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return (f"{cpu_name()}, {os.cpu_count()} cores, {', '.join(gpus) if gpus else 'no GPU'}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def stamp_rows(readme, names, stamp):
    """figs/README.md's table with the "drawn on" cell of each named figure's row set to ``stamp``.

    Rows of other figures, and the rows of diagrams ("drawn on" starting with "diagram"), stay as
    they are. A figure without a row is an error: its row says what it shows, which only a person
    can write.
    """
    lines = readme.splitlines()
    for name in names:
        row = next((i for i, line in enumerate(lines) if line.startswith(f"| [{name}]({name}) |")), None)
        if row is None:
            raise ValueError(f"figs/README.md has no row for {name}; "
                             "add one (what it shows, the notebook that draws it)")
        cells = lines[row].rstrip().rstrip("|").split(" | ")
        if not cells[-1].startswith("diagram"):
            lines[row] = " | ".join(cells[:-1] + [stamp]) + " |"
    return "\n".join(lines) + "\n"


def main():
    owners = drawn_by()
    missing = sorted(name for name in owners if not (DRAWN / name).is_file())
    if missing:
        sys.exit(f"error: {', '.join(missing)} not in {DRAWN.relative_to(REPO)}; "
                 "run `make figures` (it runs the notebooks first)")
    readme = FIGS / "README.md"
    try:
        text = stamp_rows(readme.read_text(), sorted(owners), f"{datetime.date.today():%Y-%m-%d}: {machine()}")
    except ValueError as error:
        sys.exit(f"error: {error}")
    for name in owners:
        shutil.copyfile(DRAWN / name, FIGS / name)
    readme.write_text(text)
    print(f"copied {len(owners)} figures to figs/ and stamped the measured ones in figs/README.md with this machine")


if __name__ == "__main__":
    main()
