"""How a check is registered, and how a placeholder is told from an answer. Notebook support: a learner may skip
this module.

A check is registered with its exercise's number and the names the participant defines; its notebook is the one
its module is named after (nb05_checkpoints_and_faults.py holds the checks of 05_checkpoints_and_faults.ipynb).
"""
import functools
import inspect
from dataclasses import dataclass

NOT_ATTEMPTED = "not attempted yet"
MODULE_PREFIX = "nb"  # a module name cannot start with the notebook's number


@dataclass(frozen=True)
class Exercise:
    notebook: str  # e.g. "01_baseline"
    number: int
    answers: tuple  # the names the participant defines
    check: callable
    rank_check: callable = None  # what each process runs, for a check that runs the answer in processes

    @property
    def solution(self):
        """The solution file, relative to notebooks/."""
        return f"solutions/{self.notebook[:2]}_ex{self.number}.py"

    @property
    def load_line(self):
        """The line of the notebook cell that loads the solution (from notebooks/ or workspace/)."""
        return f"# %load ../notebooks/{self.solution}"


EXERCISES = {}  # "01.2" -> Exercise


def is_placeholder(value):
    """``...``, or a function whose body is only ``...`` (or ``pass``): not written yet."""
    if value is Ellipsis:
        return True
    code = getattr(value, "__code__", None)
    return code is not None and code.co_code == _empty_function.__code__.co_code and not code.co_names


def _empty_function():
    ...


def notebook_of(module_name):
    """'notebook_support.exercises.nb01_baseline' -> '01_baseline'."""
    return module_name.rpartition(".")[2].removeprefix(MODULE_PREFIX)


def exercise(number, answers, rank_check=None):
    """Register a check of the notebook its module is named after; it prints "not attempted yet" while any answer
    is a placeholder. ``rank_check``: the function the check runs in each process (in_processes.run_check), for
    the tests to run it too."""
    def register(check):
        signature = inspect.signature(check)

        @functools.wraps(check)
        def run(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            missing = [name for name in answers if is_placeholder(given[name])]
            if missing:
                print(f"Exercise {number}: {NOT_ATTEMPTED}. Write {' and '.join(f'`{m}`' for m in missing)} "
                      "in the cell above, run it, then run this check again.")
                return
            lesson = check(*args, **kwargs)
            print(f"Exercise {number}: correct. {lesson}")

        notebook = notebook_of(check.__module__)
        EXERCISES[f"{notebook[:2]}.{number}"] = Exercise(notebook, number, tuple(answers), run, rank_check)
        return run
    return register
