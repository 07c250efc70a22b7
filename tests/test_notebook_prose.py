"""What the notebooks' prose may hold: a word budget per lesson, no figure typed where a run should print it, and a
last cell that shows the lesson's job on PBS and on Slurm, batch and interactive.

- Words: the markdown cells of notebooks 00-04 (the workshop day) hold at most 2,500 words each and 10,000
  together; 05-09 at most 2,500 each. A word is a run of characters between white space, code included.
- Figures: a number with a unit of time, size, rate, share or ratio ("25 ms", "1.9 TFLOP/s", "40%", "3.5x",
  "1e-5") typed in a markdown cell must be printed in that notebook's stored outputs, or stand in a paragraph
  (or list item) with a link to where it comes from, or be a definition listed in DEFINITIONS. Code (in backticks
  or a fenced block) is not prose and is not counted.
- Cluster cell: the last cell names a job of job_scripts/ for `qsub` and for `sbatch`, with the GPUs the job is
  for (the total of its select line's ngpus, of its --gres), and the interactive forms `qsub -I` and `salloc`.
"""
import json
import re

import pytest

from helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))
WORKSHOP_DAY = [path for path in NOTEBOOKS if path.name[:2] in {"00", "01", "02", "03", "04"}]
WORDS_PER_NOTEBOOK = 2500
WORDS_FOR_THE_WORKSHOP_DAY = 10000

NUMBER = r"(?<![\w.,/-])(\d[\d,]*(?:\.\d+)?)"
UNIT = (r"(?:ms|µs|us|ns|s|sec|seconds?|minutes?|min|hours?|h|[KMGT]i?B(?:/s)?|bytes?|[KMGTP]?FLOP/s|FLOPs?"
        r"|samples/s|images/s|steps/s|GHz|W|%|x|×)")
FIGURE = re.compile(NUMBER + r"[ \u00a0-]?" + UNIT + r"(?![\w/])")
SCIENTIFIC = re.compile(r"(?<![\w.])(\d(?:\.\d+)?e-?\d+)\b")
LINK = re.compile(r"\]\([^)]+\)|<https?://")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# Figures that are definitions of the course, not measurements: the equivalence tolerance the checks use.
DEFINITIONS = {"1e-6"}


def load(path):
    return json.loads(path.read_text())


def markdown_cells(path):
    return ["".join(cell["source"]) for cell in load(path)["cells"] if cell["cell_type"] == "markdown"]


def words(path):
    return sum(len(text.split()) for text in markdown_cells(path))


def outputs_text(path):
    text = []
    for cell in load(path)["cells"]:
        for output in cell.get("outputs", []):
            text.append("".join(output.get("text", "")))
            for kind, value in output.get("data", {}).items():
                if kind.startswith("text/"):
                    text.append("".join(value))
    return "\n".join(text).replace(",", "")


def paragraphs(markdown):
    """Blocks separated by blank lines, and each list item on its own."""
    for block in re.split(r"\n\s*\n", CODE.sub(" ", markdown)):
        yield from re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", block)


def typed_figures(markdown, printed):
    """The figures of ``markdown`` that ``printed`` (the outputs, commas removed) does not show, that stand in
    no paragraph with a link, and that are no definition."""
    found = []
    for paragraph in paragraphs(markdown):
        if LINK.search(paragraph):
            continue
        for match in [*FIGURE.finditer(paragraph), *SCIENTIFIC.finditer(paragraph)]:
            number = match.group(1).replace(",", "")
            if number in DEFINITIONS or re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", printed):
                continue
            found.append(match.group(0))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_each_notebook_is_one_lesson_of_at_most_2500_words(path):
    assert words(path) <= WORDS_PER_NOTEBOOK, (
        f"{path.name} has {words(path)} words of markdown, over {WORDS_PER_NOTEBOOK}: move reference detail to docs/")


def test_the_workshop_day_reads_in_at_most_10000_words():
    counts = {path.name: words(path) for path in WORKSHOP_DAY}
    assert len(counts) == 5 and sum(counts.values()) <= WORDS_FOR_THE_WORKSHOP_DAY, counts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_no_figure_is_typed_that_no_output_prints_and_no_link_backs(path):
    printed = outputs_text(path)
    typed = {number: figures for number, text in enumerate(load(path)["cells"])
             if text["cell_type"] == "markdown"
             and (figures := typed_figures("".join(text["source"]), printed))}
    assert not typed, (
        f"{path.name}: figures typed in markdown cells {typed} are printed by no cell of the notebook and have no "
        "link in their paragraph: print them in a cell and refer to the output, or link their source")


def test_the_figure_check_finds_a_typed_figure_and_accepts_a_printed_or_linked_one():
    printed = "allreduce 25 ms\nratio 3.5x\nloss 1.2e-05".replace(",", "")
    assert typed_figures("The step took 37.2 ms on this machine.", printed) == ["37.2 ms"]
    assert typed_figures("Adam magnifies it to about 1e-5.", printed) == ["1e-5"]
    assert typed_figures("Overlap saves 40% of the step.\n\n- and 2x here", printed) == ["40%", "2x"]
    assert typed_figures("The all_reduce above took 25 ms, a 3.5x gain.", printed) == []
    assert typed_figures("An H200 peaks at 989 TFLOP/s ([data sheet](https://nvidia.com/h200)).", printed) == []
    assert typed_figures("Run `--timeout 30 s` and\n```\nsleep 90 s\n```\nwithin 1e-6.", printed) == []
    assert typed_figures("Run 4 steps on 2 GPUs of torch 2.14.1.", printed) == []


def job_gpus_pbs(job):
    """GPUs a PBS job is for: chunks x ngpus of its select line (the #PBS one, else its ##PBS GPU form)."""
    lines = re.findall(r"^##?PBS -l (select=\S+)", job.read_text(), re.M)
    with_gpus = [line for line in lines if "ngpus=" in line]
    return select_gpus(with_gpus[0]) if with_gpus else 0


def select_gpus(select):
    chunks = re.match(r"select=(\d+)", select)
    ngpus = re.search(r"ngpus=(\d+)", select)
    return (int(chunks.group(1)) if chunks else 1) * (int(ngpus.group(1)) if ngpus else 0)


def job_gpus_slurm(job):
    text = job.read_text()
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", text, re.M)
    gres = re.search(r"^#SBATCH --gres=gpu:(?:\w+:)?(\d+)", text, re.M)
    return (int(nodes.group(1)) if nodes else 1) * (int(gres.group(1)) if gres else 0)


def submissions(cell, command, suffix):
    """(line, job path) for each `command ... job_scripts/NAME.suffix` in ``cell``."""
    return [(line, REPO / "job_scripts" / name) for line in cell.splitlines()
            for name in re.findall(rf"\b{command}\b.*?\bjob_scripts/([\w.-]+\.{suffix})\b", line)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_the_last_cell_shows_the_job_on_pbs_and_slurm_with_its_gpus(path):
    cell = "".join(load(path)["cells"][-1]["source"])
    pbs, slurm = submissions(cell, "qsub", "pbs"), submissions(cell, "sbatch", "sbatch")
    assert pbs and slurm, f"{path.name}'s last cell names no `qsub job_scripts/X.pbs` and `sbatch ...sbatch` line"
    for _, job in pbs + slurm:
        assert job.exists(), f"{path.name}'s last cell names {job.name}, which job_scripts/ does not have"
    asked = {job.name: job_gpus_pbs(job) for _, job in pbs}
    shown = {job.name: select_gpus(re.search(r"select=\S+", line).group(0)) if "select=" in line
             else job_gpus_pbs(job) for line, job in pbs}
    assert any(shown[name] == gpus for name, gpus in asked.items()), (
        f"{path.name}: no qsub line asks for the GPUs its job is for: {shown} vs {asked}")
    assert any(job_gpus_slurm(job) == asked.get(job.name.replace(".sbatch", ".pbs"), job_gpus_slurm(job))
               for _, job in slurm)
    for interactive in ("qsub -I", "salloc"):
        assert interactive in cell, f"{path.name}'s last cell does not show the interactive form `{interactive}`"


@pytest.mark.parametrize("page", ["README.md", "notebooks/README.md"])
def test_the_course_maps_list_every_notebook(page):
    rows = [line for line in (REPO / page).read_text().splitlines() if line.startswith("|")]
    missing = [path.stem for path in NOTEBOOKS if not any(path.stem in row for row in rows)]
    assert not missing, f"{page}'s table of the notebooks has no row for {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebooks_readme_names_the_jobs_of_each_last_cell(path):
    cell = "".join(load(path)["cells"][-1]["source"])
    jobs = set(re.findall(r"job_scripts/([\w.-]+)\.(?:pbs|sbatch)\b", cell))
    row = next(line for line in (REPO / "notebooks" / "README.md").read_text().splitlines()
               if line.startswith(f"| [{path.name}]"))
    assert jobs and all(f"`{job}`" in row.split(" | ")[-1] for job in jobs), (
        f"notebooks/README.md's row for {path.name} should name the jobs its last cell shows: {sorted(jobs)}")
