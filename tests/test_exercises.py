"""The exercises of the notebooks: every notebook has its module of checks and every exercise its check; each
check passes the solution, fails a wrong answer, and says "not attempted yet" for the placeholder; and no stored
notebook shows an answer.

A solution lives in notebooks/solutions/ and reaches a notebook only when the participant
uncomments its `%load` line, so these tests run every solution file the way the notebook
would: in a namespace holding what the notebook defined before the exercise.
"""
import json
import re
from pathlib import Path

import pytest
import torch

from helpers import REPO
from lesson import data, models
from notebook_support import exercises
from notebook_support.exercises import EXERCISES, NOT_ATTEMPTED, is_placeholder
from notebook_support.exercises.registry import MODULE_PREFIX, notebook_of

NOTEBOOKS = REPO / "notebooks"
SOLUTIONS = NOTEBOOKS / "solutions"
NOTEBOOK_NAMES = sorted(path.stem for path in NOTEBOOKS.glob("[0-9]*.ipynb"))  # "00_concepts", ...
CHECK_MODULES = sorted(Path(exercises.__file__).parent.glob(f"{MODULE_PREFIX}*.py"))  # nb00_concepts.py, ...


@pytest.fixture(scope="module")
def train_set():
    return data.load_datasets("mnist5k", REPO / "data")[0]


@pytest.fixture(scope="module")
def ddp_buckets(ddp_mechanics_run):
    """What DDP did with its buckets, from a real torchrun of the demo (notebook 04 shows the same; tests/conftest.py
    makes the run once for the session, and test_ddp_demos.py checks it too)."""
    _, observed, _, _ = ddp_mechanics_run
    return observed["buckets"]


@pytest.fixture(scope="module")
def beyond_observed(beyond_demo_run):
    """What gradient accumulation and ZeRO-1 did, from a real torchrun of the demos (notebook 07 shows the same;
    tests/conftest.py makes the run once for the session, and test_beyond.py checks it too)."""
    return beyond_demo_run("all-but-fsdp")[1]


def prefixed_checkpoint(tmp_path):
    """Notebook 04, exercise 1: a checkpoint saved the wrong way, from ddp_model.state_dict()."""
    torch.manual_seed(1)
    path = tmp_path / "prefixed.pt"
    torch.save({f"module.{key}": value for key, value in models.Net(dropout=False).state_dict().items()}, path)
    return path


def context(exercise_id, request, tmp_path):
    """What the notebook has defined when the participant reaches the exercise; the check's extra arguments."""
    if exercise_id == "02.2":
        return {"train_set": request.getfixturevalue("train_set")}, {}
    if exercise_id == "04.1":
        path = prefixed_checkpoint(tmp_path)
        return {"PREFIXED": path}, {"checkpoint": path}
    if exercise_id == "04.2":
        return {}, {"observed": request.getfixturevalue("ddp_buckets")}
    if exercise_id == "07.2":
        numels = [p.numel() for p in models.Net().parameters()]
        return {}, {"observed": request.getfixturevalue("beyond_observed")["zero"], "parameter_numels": numels}
    return {}, {}


def run_solution(exercise, names):
    """Execute the solution file as the loaded cell would run; return the answers it defines."""
    namespace = dict(names)
    exec(compile((NOTEBOOKS / exercise.solution).read_text(), exercise.solution, "exec"), namespace)
    return {name: namespace[name] for name in exercise.answers}


def wrong_where(rank, gpus_per_node):
    return rank // gpus_per_node, rank % gpus_per_node, f"cuda:{rank}"  # the bug the exercise is about


def wrong_predict(world_size):
    summed = [sum(range(1, world_size + 1)) * v for v in (1, 10, 100)]
    gathered = [[10 * r, 10 * r + 1] for r in range(world_size)]
    return {"all_reduce": [summed] * world_size, "all_reduce_mean": [summed] * world_size,  # forgot to divide
            "all_gather": [gathered] * world_size}


def wrong_shard(n, world_size, rank, seed, epoch):
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()[rank::world_size]  # no padding


def one_bucket(numels, caps_bytes):
    return [sum(numels)]


def wrong_answers(exercise_id, extra):
    """A plausible mistake for every exercise: each must fail its check."""
    model_bytes = sum(p.numel() * 4 for p in models.Net().parameters())
    return {
        "00.1": {"where": wrong_where, "crash_with_global_rank": list(range(4, 12))},
        "00.2": {"predict": wrong_predict},
        "01.2": {"repeated": {w: 10_000 % w for w in range(1, 9)}},
        "02.1": {"shard": wrong_shard},
        "02.2": {"overlap": 0, "never_seen": 0},  # what the same seed on every rank would give
        "03.1": {"sizes_100_on_3": [33, 33, 34], "gpus_working_2_on_4": 4},
        "03.2": {"per_step": model_bytes * 4, "per_epoch": model_bytes * 4 * 235},  # GPU 0 needs no copy
        "04.1": {"rescued": models.Net(dropout=False)},  # fresh weights, nothing loaded
        "04.2": {"predict_buckets": one_bucket},
        "06.2": {"replica_gpus": lambda rank, gpus, processes: (rank // processes, 2 * rank, 2 * rank + 1)},  # global
        "07.2": {"zero_state_per_rank": lambda numels, world_size: [8 * sum(numels) // world_size] * world_size},
        "08.2": {"communication_share": lambda batch, flops, rate, size, busbw, ranks:  # the batch's gradient
                 (batch * size / busbw) / (batch * flops / rate + batch * size / busbw)},
        "09.1": {"odd_rank": 2, "odd_line": 175},  # the right rank, but the line where the others wait
        "09.2": {"culprit": 0, "steps_done": 2, "root_cause": 0},  # torchrun's root cause taken for the culprit
    }[exercise_id]


def placeholder_function(*args):
    ...


IDS = sorted(EXERCISES)
# The checks that run the participant's code in processes have their own tests, with every usual mistake
# (test_exercises_in_processes.py); here, their placeholders. Of the others, those that start processes, read a
# real run or build ResNet-18s are slow.
IN_PROCESSES = {exercise_id for exercise_id in IDS if EXERCISES[exercise_id].rank_check}
NEEDS_A_RUN = {"00.2", "04.2", "07.2"}
ALL = [pytest.param(exercise_id, marks=pytest.mark.slow) if exercise_id in NEEDS_A_RUN else exercise_id
       for exercise_id in IDS]
CHECKED = [param for param, exercise_id in zip(ALL, IDS) if exercise_id not in IN_PROCESSES]


def test_every_notebook_has_a_module_of_checks_and_every_module_a_notebook():
    assert [notebook_of(path.stem) for path in CHECK_MODULES] == NOTEBOOK_NAMES


def test_every_notebook_has_exercises():
    """A module of checks that exercises/__init__.py does not import registers nothing: its notebook fails here."""
    assert sorted({exercise.notebook for exercise in EXERCISES.values()}) == NOTEBOOK_NAMES


@pytest.mark.parametrize("exercise_id", CHECKED)
def test_the_solution_passes_its_check(exercise_id, request, tmp_path, capsys):
    exercise = EXERCISES[exercise_id]
    names, extra = context(exercise_id, request, tmp_path)
    answers = run_solution(exercise, names)
    exercise.check(**answers, **extra)
    assert f"Exercise {exercise.number}: correct." in capsys.readouterr().out


@pytest.mark.parametrize("exercise_id", CHECKED)
def test_a_wrong_answer_fails_its_check(exercise_id, request, tmp_path):
    exercise = EXERCISES[exercise_id]
    _, extra = context(exercise_id, request, tmp_path)
    with pytest.raises(AssertionError):
        exercise.check(**wrong_answers(exercise_id, extra), **extra)


@pytest.mark.parametrize("exercise_id", ALL)
def test_a_placeholder_is_not_attempted_and_does_not_fail(exercise_id, request, tmp_path, capsys):
    exercise = EXERCISES[exercise_id]
    _, extra = context(exercise_id, request, tmp_path)
    answers = {name: ... for name in exercise.answers}
    exercise.check(**answers, **extra)
    printed = capsys.readouterr().out
    assert f"Exercise {exercise.number}: {NOT_ATTEMPTED}." in printed
    assert "correct" not in printed


def test_placeholders_are_told_from_answers():
    def written(rank):
        return rank

    assert is_placeholder(...) and is_placeholder(placeholder_function)
    assert not any(is_placeholder(value) for value in (0, None, [], written, lambda: ...))


# ---------------------------------------------------------------- what the stored notebooks show

def cells(notebook):
    return json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())["cells"]


def text_of(cell):
    source = "".join(cell["source"])
    outputs = "".join("".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
                      for output in cell.get("outputs", []))
    return source, outputs


def placeholder_pattern(name):
    """`name = ...` or a `def name(...):` whose body is `...`."""
    return re.compile(rf"^(?:{name} = \.\.\.|def {name}\(.*\):\n\s+\.\.\.)", re.M)


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_notebook_holds_placeholder_load_line_and_check(exercise_id):
    exercise = EXERCISES[exercise_id]
    notebook = cells(exercise.notebook)
    sources = ["".join(cell["source"]) for cell in notebook]
    at = [i for i, source in enumerate(sources) if exercise.load_line in source.splitlines()]
    assert len(at) == 1, f"{exercise.notebook}: expected one cell with the line {exercise.load_line!r}"
    answer, load, check = notebook[at[0] - 1], notebook[at[0]], notebook[at[0] + 1]
    for name in exercise.answers:
        assert placeholder_pattern(name).search("".join(answer["source"])), f"no placeholder for {name} above"
    assert not load["outputs"], "the load cell must stay empty until the participant runs it"
    check_source, check_output = text_of(check)
    assert f"exercises.{exercise.check.__name__}(" in check_source
    assert getattr(exercises, exercise.check.__name__) is exercise.check, "not imported by exercises/__init__.py"
    assert f"Exercise {exercise.number}: {NOT_ATTEMPTED}." in check_output, "stored with the answer filled in?"
    assert all(output["output_type"] == "stream" for output in check["outputs"]), "the check shows only its line"
    assert (NOTEBOOKS / exercise.solution).is_file()


@pytest.mark.parametrize("notebook", NOTEBOOK_NAMES)
def test_every_exercise_of_the_notebook_has_a_check(notebook):
    """An exercise shows as the %load line of its solution: each one in the notebook is a check's."""
    load_lines = {line for cell in cells(notebook) for line in "".join(cell["source"]).splitlines()
                  if line.startswith("# %load ")}
    assert load_lines == {exercise.load_line for exercise in EXERCISES.values() if exercise.notebook == notebook}


def test_every_solution_file_has_a_check():
    assert sorted(SOLUTIONS.glob("*.py")) == sorted(NOTEBOOKS / exercise.solution for exercise in EXERCISES.values())


def solution_lines():
    """Every line of code in the solution files (no comments, no imports, no blank lines)."""
    lines = set()
    for path in SOLUTIONS.glob("*.py"):
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if len(line) > 12 and not line.startswith(("import ", "from ", "def ", "return ")):
                lines.add(line)
    return lines


@pytest.mark.parametrize("notebook", NOTEBOOK_NAMES)
def test_no_answer_is_on_screen(notebook):
    answers = solution_lines()
    for number, cell in enumerate(cells(notebook)):
        source, outputs = text_of(cell)
        assert "solution" not in cell["metadata"].get("tags", []), f"cell {number} is tagged as a solution"
        shown = {line.split("#")[0].strip() for line in source.splitlines()}
        assert not shown & answers, f"cell {number} of {notebook} holds a solution line: {shown & answers}"
        assert not re.search(r"Exercise \d+: correct\.", outputs), f"cell {number} of {notebook} shows a solved check"
