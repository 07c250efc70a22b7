"""The exercises in which the participant writes distributed code: each check runs the participant's function in 2
gloo processes under torchrun. For every such check, the solution passes and each usual mistake (tests/
exercise_mistakes/) fails with its one-line hint; the solution and the mistakes of one exercise share one torchrun.
"""
import importlib
import pkgutil

import pytest

import exercise_mistakes
from helpers import REPO
from notebook_support.exercises import EXERCISES, in_processes

pytestmark = pytest.mark.slow  # one torchrun of 2 processes per exercise

MISTAKE_MODULES = {module.EXERCISE: module for module in (importlib.import_module(f"exercise_mistakes.{info.name}")
                                                          for info in pkgutil.iter_modules(exercise_mistakes.__path__))}
IN_PROCESSES = sorted(MISTAKE_MODULES)


def solution_answers(exercise):
    """The solution file, run as the loaded cell would run it (its path as the code's file name, so that the check
    can read the functions' source)."""
    path = REPO / "notebooks" / exercise.solution
    namespace = {"__name__": "solution"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return {name: namespace[name] for name in exercise.answers}


@pytest.fixture(scope="module")
def runs():
    """exercise id -> (the solution's verdict, [each mistake's verdict]), one torchrun per exercise, made when a
    test first asks for it."""
    made = {}

    def run(exercise_id):
        if exercise_id not in made:
            exercise = EXERCISES[exercise_id]
            mistakes = MISTAKE_MODULES[exercise_id].MISTAKES
            answer_sets = [solution_answers(exercise)] + [answers for answers, _ in mistakes]
            verdicts = in_processes.verdicts(exercise.rank_check, answer_sets)
            made[exercise_id] = verdicts[0], verdicts[1:]
        return made[exercise_id]

    return run


def test_every_notebook_from_01_to_07_has_an_exercise_run_in_processes():
    notebooks = {exercise_id[:2] for exercise_id in EXERCISES if EXERCISES[exercise_id].rank_check}
    assert {f"{n:02}" for n in range(1, 8)} <= notebooks
    assert {exercise_id for exercise_id in EXERCISES if EXERCISES[exercise_id].rank_check} == set(IN_PROCESSES)


@pytest.mark.parametrize("exercise_id", IN_PROCESSES)
def test_the_solution_passes_in_two_processes(exercise_id, runs, monkeypatch, capsys):
    (problem, details), _ = runs(exercise_id)
    assert problem is None
    assert all(detail is not None for detail in details)
    # The notebook's check, on the same answers, reads the verdicts of that run instead of starting another.
    exercise = EXERCISES[exercise_id]
    monkeypatch.setattr(in_processes, "verdicts", lambda rank_check, answer_sets, nproc=2: [(problem, details)])
    exercise.check(**solution_answers(exercise))
    assert f"Exercise {exercise.number}: correct." in capsys.readouterr().out


@pytest.mark.parametrize("exercise_id, number", [(exercise_id, number) for exercise_id in IN_PROCESSES
                                                  for number in range(len(MISTAKE_MODULES[exercise_id].MISTAKES))])
def test_each_usual_mistake_fails_with_its_hint(exercise_id, number, runs):
    _, verdicts = runs(exercise_id)
    (problem, _), (answers, hint) = verdicts[number], MISTAKE_MODULES[exercise_id].MISTAKES[number]
    assert problem is not None, f"{answers} passed the check"
    assert hint in problem, f"{hint!r} is not in the check's line: {problem!r}"
    assert "\n" not in problem
