"""Every link between the course's own files leads somewhere: the README, notebooks/README.md, the guides in docs/
and the notebooks' markdown cells name files that exist, and a #section of a markdown file names one of its
headings (as GitHub makes anchors of them). Notebooks that move text to a guide link to the section that holds it."""
import json
import re
from pathlib import Path

import pytest

from helpers import MARKDOWN_CODE as CODE
from helpers import NOTEBOOKS, REPO

PAGES = [REPO / "README.md", REPO / "notebooks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_of(path):
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    return path.read_text()


def anchors(markdown):
    """GitHub's anchors for the headings of ``markdown``: lower case, punctuation but - and _ dropped, spaces as
    -, and -1, -2 ... after a repeated one."""
    seen, found = {}, set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCED.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(path):
    broken = []
    for target in LINK.findall(CODE.sub("", markdown_of(path))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target} (no file {Path(file)})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(markdown_of(linked)):
            broken.append(f"{target} (no heading #{anchor} in {file or path.name})")
    return broken


@pytest.mark.parametrize("path", PAGES + NOTEBOOKS, ids=[str(path.relative_to(REPO)) for path in PAGES + NOTEBOOKS])
def test_every_link_to_a_file_of_the_course_leads_to_it(path):
    assert not broken_links(path), f"{path.relative_to(REPO)} links to what is not there: {broken_links(path)}"


def test_the_anchors_are_githubs():
    assert anchors("# 1. A multi-node job hangs at start-up\n## `make run`, then?\n## Notes\n## Notes") == {
        "1-a-multi-node-job-hangs-at-start-up", "make-run-then", "notes", "notes-1"}


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    (tmp_path / "guide.md").write_text("# Guide\n## Checkpoints\n")
    page = tmp_path / "page.md"
    page.write_text("See [it](guide.md#checkpoints), [that](guide.md#restarts) and [this](gone.md).\n")
    assert broken_links(page) == ["guide.md#restarts (no heading #restarts in guide.md)", "gone.md (no file gone.md)"]


# A path of the course in prose or code, not the text of a link to another repository.
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:scripts|job_scripts|benchmarks|notebooks|docs|tests)/[\w/.-]*\w"
                        r"\.(?:py|pbs|sbatch|sh|md|ipynb|json|cfg))\b(?!\]\(https?:)")
PAGES_THAT_NAME_FILES = PAGES + [REPO / "data" / "README.md", REPO / "figs" / "README.md"]


def missing_files(path):
    """Files of the course that ``path``'s text names (in prose or code: `python scripts/tools/x.py`) but that do
    not exist; a name with a wildcard or a placeholder is not a file."""
    return sorted({name for name in NAMED_FILE.findall(markdown_of(path))
                   if not (REPO / name).exists() and not re.search(r"[*<>]|\bNN\b|NN_|/X\.|_x\.", name)})


@pytest.mark.parametrize("path", PAGES_THAT_NAME_FILES + NOTEBOOKS,
                         ids=[str(path.relative_to(REPO)) for path in PAGES_THAT_NAME_FILES + NOTEBOOKS])
def test_every_file_of_the_course_a_page_names_exists(path):
    assert not missing_files(path), f"{path.relative_to(REPO)} names files that do not exist: {missing_files(path)}"


def test_a_named_file_that_is_gone_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `python scripts/download_data.py mnist`, then scripts/tools/download_data.py and "
                    "notebooks/solutions/NN_exK.py; PyTorch's [benchmarks/ddp/README.md](https://github.com/x).\n")
    assert missing_files(page) == ["scripts/download_data.py"]
