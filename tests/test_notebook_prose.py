"""What the notebooks' prose may hold: a word budget per lesson, no figure typed where a run should print it, and a
last cell that shows the lesson's job on PBS and on Slurm, batch and interactive.

- Words: the markdown cells of notebooks 00-04 (the workshop day) hold at most 2,500 words each and 10,000
  together; 05-09 at most 2,500 each. A word is a run of word characters (\\w+), code and paths included:
  torch/distributed/run.py is four.
- Figures: a number with a unit of time, size, rate, share or ratio ("25 ms", "1.9 TFLOP/s", "40%", "3.5x",
  "1e-5") typed in a markdown cell must be printed in that notebook's stored outputs, or stand in a paragraph
  (or list item) with a link to where it comes from, or be a definition listed in DEFINITIONS. Code (in backticks
  or a fenced block) is not prose and is not counted.
- Cluster cell: the last cell names a job of job_scripts/ for `qsub` and for `sbatch`, with the GPUs the job is
  for (the total of its select line's ngpus, of its --gres), and the interactive forms `qsub -I` and `salloc`.
"""
import re

import pytest

from helpers import MARKDOWN_CODE as CODE
from helpers import NOTEBOOKS, REPO, outputs_text
from helpers import load_notebook as load

WORKSHOP_DAY = [path for path in NOTEBOOKS if path.name[:2] in {"00", "01", "02", "03", "04"}]
WORDS_PER_NOTEBOOK = 2500
WORDS_FOR_THE_WORKSHOP_DAY = 10000

NUMBER = r"(?<![\w.,/-])(\d[\d,]*(?:\.\d+)?)"
UNIT = (r"(?:ms|µs|us|ns|s|sec|seconds?|minutes?|min|hours?|h|[KMGT]i?B(?:/s)?|bytes?|[KMGTP]?FLOP/s|FLOPs?"
        r"|samples/s|images/s|steps/s|GHz|W|%|x(?!\s*\d)|×(?!\s*[\w(]))")  # "2 x 4", "64 × 32": a product
FIGURE = re.compile(NUMBER + r"[ \u00a0-]?" + UNIT + r"(?![\w/])")
SCIENTIFIC = re.compile(r"(?<![\w.])(\d(?:\.\d+)?e-?\d+)\b")
LINK = re.compile(r"\]\([^)]+\)|<https?://")
# Figures that are definitions, not measurements: the equivalence tolerance the checks use, the sizes of float32
# values and of Adam's state per parameter, a multiply-add's FLOPs, the timeouts and sweep range the cells choose.
DEFINITIONS = {"1e-6", "4 bytes", "16 bytes", "2 FLOPs", "3 seconds", "256 MiB"}


def markdown_cells(path):
    return ["".join(cell["source"]) for cell in load(path)["cells"] if cell["cell_type"] == "markdown"]


def words(path):
    return sum(len(re.findall(r"\w+", text)) for text in markdown_cells(path))


def printed_text(path):
    """Everything the notebook's cells printed, commas removed (1,660 reads as 1660)."""
    return "\n".join(outputs_text(cell) for cell in load(path)["cells"]).replace(",", "")


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
            unit = match.group(0)[len(match.group(1)):].strip(" \u00a0-")  # "" for 1e-5
            as_printed = rf"(?<![\d.]){re.escape(number)}[ \u00a0-]?{re.escape(unit)}(?![\w/]|\.\d)"
            if DEFINITIONS & {number, match.group(0)} or re.search(as_printed, printed):
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
    printed = printed_text(path)
    typed = {number: figures for number, cell in enumerate(load(path)["cells"])
             if cell["cell_type"] == "markdown"
             and (figures := typed_figures("".join(cell["source"]), printed))}
    assert not typed, (
        f"{path.name}: figures typed in markdown cells {typed} are printed by no cell of the notebook and have no "
        "link in their paragraph: print them in a cell and refer to the output, or link their source")


def test_the_figure_check_finds_a_typed_figure_and_accepts_a_printed_or_linked_one():
    printed = "allreduce 25 ms\nratio 3.5x\nloss 1.2e-05\nrank 2 of 4, step 3, took 37.9 s".replace(",", "")
    assert typed_figures("The step took 37.2 ms on this machine.", printed) == ["37.2 ms"]
    assert typed_figures("Adam magnifies it to about 1e-5.", printed) == ["1e-5"]
    assert typed_figures("Overlap saves 40% of the step.\n\n- and 2x here", printed) == ["40%", "2x"]
    assert typed_figures("The all_reduce above took 25 ms, a 3.5x gain.", printed) == []
    assert typed_figures("An H200 peaks at 989 TFLOP/s ([data sheet](https://nvidia.com/h200)).", printed) == []
    assert typed_figures("Run `--timeout 30 s` and\n```\nsleep 90 s\n```\nwithin 1e-6.", printed) == []
    assert typed_figures("Run 4 steps on 2 GPUs of torch 2.14.1.", printed) == []
    # The number must be printed with its unit: a rank, a count or another figure that happens to share it is not it.
    assert typed_figures("It took 2 ms, a 4x gain, 3% of the step; 37 s in all.", printed) == [
        "2 ms", "4x", "3%", "37 s"]
    assert typed_figures("A batch of 64 × 32 images on 2 x 4 GPUs, float32: 4 bytes each.", printed) == []


def gpus_asked_as_shipped(job):
    """GPUs a PBS job asks for as it is: chunks x ngpus of its #PBS select line."""
    line = re.search(r"^#PBS -l (select=\S+)", job.read_text(), re.M)
    return select_gpus(line.group(1)) if line else 0


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


def cluster_cell_problems(cell):
    """What the last cell ``cell`` lacks: a qsub and an sbatch line of existing jobs, a qsub line that submits its job
    with the GPUs the job asks for, an sbatch job asking for as many GPUs as its PBS twin, the override for a site
    without GPUs (a qsub select without ngpus, sbatch --gres=none), and the interactive forms."""
    pbs, slurm = submissions(cell, "qsub", "pbs"), submissions(cell, "sbatch", "sbatch")
    if not (pbs and slurm):
        return ["no `qsub job_scripts/X.pbs` and `sbatch job_scripts/X.sbatch` line"]
    missing = [job.name for _, job in pbs + slurm if not job.exists()]
    if missing:
        return [f"names {missing}, which job_scripts/ does not have"]
    problems = []
    asked = {job.name: gpus_asked_as_shipped(job) for _, job in pbs}
    shown = {line: select_gpus(re.search(r"select=\S+", line).group(0)) if "select=" in line
             else gpus_asked_as_shipped(job) for line, job in pbs}
    if not any(gpus and gpus == asked[job.name] for (line, job), gpus in zip(pbs, shown.values())):
        problems.append(f"no qsub line submits its job with the GPUs the job asks for: {asked}")
    twins = [(job, job.with_suffix(".pbs")) for _, job in slurm]
    if not any(twin.exists() and job_gpus_slurm(job) == gpus_asked_as_shipped(twin) for job, twin in twins):
        problems.append("no sbatch job asks for as many GPUs as its PBS twin")
    if not any("select=" in line and shown[line] == 0 for line, _ in pbs) or "sbatch --gres=none" not in cell:
        problems.append("no override for a site without GPUs (qsub -l select=... without ngpus, sbatch --gres=none)")
    problems += [f"no interactive `{form}`" for form in ("qsub -I", "salloc") if form not in cell]
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_the_last_cell_shows_the_job_on_pbs_and_slurm_with_its_gpus(path):
    problems = cluster_cell_problems("".join(load(path)["cells"][-1]["source"]))
    assert not problems, f"{path.name}'s last cell: {problems}"


def test_the_cluster_cell_check_finds_a_job_submitted_without_its_gpus():
    interactive = "qsub -I -l select=1:ncpus=16:ngpus=2\nsalloc --gres=gpu:2\n"
    cpus = "qsub -l select=1:ncpus=4:mem=8gb job_scripts/04_ddp.pbs\nsbatch --gres=none job_scripts/04_ddp.sbatch\n"
    good = "qsub job_scripts/04_ddp.pbs\nsbatch job_scripts/04_ddp.sbatch\n"  # as shipped: 2 GPUs
    assert cluster_cell_problems(good + cpus + interactive) == []
    assert cluster_cell_problems(cpus + interactive) == [
        "no qsub line submits its job with the GPUs the job asks for: {'04_ddp.pbs': 2}"]
    assert cluster_cell_problems(good + interactive) == [
        "no override for a site without GPUs (qsub -l select=... without ngpus, sbatch --gres=none)"]
    assert cluster_cell_problems(good + cpus) == ["no interactive `qsub -I`", "no interactive `salloc`"]


@pytest.mark.parametrize("page", ["README.md", "notebooks/README.md"])
def test_the_course_maps_list_every_notebook(page):
    rows = [line for line in (REPO / page).read_text().splitlines() if line.startswith("|")]
    missing = [path.stem for path in NOTEBOOKS if not any(path.stem in row for row in rows)]
    assert not missing, f"{page}'s table of the notebooks has no row for {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebooks_readme_names_the_jobs_of_each_last_cell(path):
    cell = "".join(load(path)["cells"][-1]["source"])
    jobs = set(re.findall(r"job_scripts/([\w.-]+)\.(?:pbs|sbatch)\b", cell))
    rows = [line for line in (REPO / "notebooks" / "README.md").read_text().splitlines()
            if line.startswith(f"| [{path.name}]")]
    assert rows, f"notebooks/README.md has no row for {path.name}"
    row = rows[0]
    assert jobs and all(f"`{job}`" in row.split(" | ")[-1] for job in jobs), (
        f"notebooks/README.md's row for {path.name} should name the jobs its last cell shows: {sorted(jobs)}")
