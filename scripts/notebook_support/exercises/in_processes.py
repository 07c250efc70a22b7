"""Run a participant's function in real processes, as the exercises that ask for distributed code need. Notebook
support: a learner may skip this module.

A notebook's kernel cannot hand a function to other processes (notebook 00 shows why mp.spawn fails). So
``run_check`` writes the function's source to a file, with an import line for every module or library name it
uses, and starts ``notebook_support/exercise_worker.py`` under torchrun: 2 gloo processes on this machine. Each
process loads the file and runs the exercise's *rank check*, a function of the exercise's module that calls the
participant's code with the real torch.distributed and says in one line what is wrong, with a hint. Each rank
writes its verdict to a file; the kernel reads them. A rank that hangs waits at most ``TIMEOUT_SECONDS``, the
process group's timeout, then fails in the collective where it waited.

``verdicts`` runs several answers in one torchrun, one after another in the same process group: the tests use
it to run the solution and every listed wrong answer at the cost of one start.
"""
import ast
import contextlib
import dis
import inspect
import json
import re
import sys
import tempfile
import textwrap
import types
from pathlib import Path

from notebook_support.runs import torchrun

WORKER = "notebook_support/exercise_worker.py"
TIMEOUT_SECONDS = 30  # the worker's process-group timeout: how long a rank waits for a collective that never comes
RUN_LIMIT_SECONDS = 300  # the whole torchrun, startup included, on a loaded 2-core machine
PLAIN_VALUES = (bool, int, float, str, type(None))


class NotTransferable(AssertionError):
    """The answer uses a value the worker processes cannot get from its source."""


def run_check(rank_check, nproc=2, **answers):
    """Run ``rank_check`` on ``answers`` (names -> functions) in ``nproc`` gloo processes; return rank 0's detail.
    A wrong answer raises AssertionError with the first rank's one-line verdict."""
    [(problem, details)] = verdicts(rank_check, [answers], nproc)
    if problem:
        raise AssertionError(problem)
    return details[0]


def verdicts(rank_check, answer_sets, nproc=2):
    """For each dict of answers: (the first problem any rank found, or None; every rank's detail), from one
    torchrun in which every set runs in turn."""
    with tempfile.TemporaryDirectory(prefix="exercise-") as folder:
        folder = Path(folder)
        for number, answers in enumerate(answer_sets):
            (folder / f"answer{number}.py").write_text(module_source(answers))
        check = f"{rank_check.__module__}:{rank_check.__name__}"
        try:
            output = torchrun(WORKER, "--check", check, "--answers", len(answer_sets), "--folder", folder,
                              nproc=nproc, timeout=RUN_LIMIT_SECONDS, echo=False)
        except Exception as failure:  # noqa: BLE001 (RunFailed or a timeout: the rank files say what got done)
            output = str(failure)
        ranks = [read_rank(folder, rank) for rank in range(nproc)]
    return [combine(ranks, number, output) for number in range(len(answer_sets))]


def read_rank(folder, rank):
    path = folder / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else []


def combine(ranks, number, output):
    problems, details = [], []
    for rank, results in enumerate(ranks):
        if number >= len(results):
            problems.append(f"rank {rank} stopped before its verdict; the run ended with: {last_error(output)}")
            details.append(None)
            continue
        problem, detail = results[number]
        if problem:
            problems.append(problem)
        details.append(detail)
    return (problems[0] if problems else None), details


def last_error(output):
    """The run's last error line, else its last line with words in it."""
    lines = [line.strip() for line in output.splitlines() if re.search(r"\w", line)] or ["(no output)"]
    return next((line for line in reversed(lines) if re.search(r"(Error|Exception)\b|^error:", line)), lines[-1])


# ---------------------------------------------------------------- the answer, as a module the workers import

def module_source(answers):
    """A module that defines each answer under its name: the functions' source, that of the notebook's functions
    they call, and an import line for each module or library name they use."""
    imports, sources, aliases, seen = [], [], [], set()
    for name, function in answers.items():
        function = inspect.unwrap(function)  # a decorated function: its source holds the decorator line
        if not inspect.isfunction(function) or function.__name__ == "<lambda>":
            raise NotTransferable(f"`{name}` must be a function written with `def`")
        collect(function, function, imports, sources, seen)
        if function.__name__ != name:
            aliases.append(f"{name} = {function.__name__}")
    return "\n".join(dict.fromkeys(imports)) + "\n\n\n" + "\n\n\n".join(sources) + "\n\n" + "\n".join(aliases) + "\n"


def collect(function, answer, imports, sources, seen):
    """Add ``function``'s source to ``sources`` (once), and what its global names need to ``imports``."""
    if function in seen:
        return
    seen.add(function)
    source = textwrap.dedent(inspect.getsource(function))
    for name in sorted(global_names(function.__code__) | decorator_names(source)):
        if name not in function.__globals__:
            continue  # a builtin, or a name the worker reports as undefined when the code runs
        value = function.__globals__[name]
        if isinstance(value, types.ModuleType):
            imports.append(f"import {value.__name__} as {name}" if value.__name__ != name else f"import {name}")
        elif written_alongside(inspect.unwrap(value) if callable(value) else value, function):
            if value.__name__ == "<lambda>":
                raise NotTransferable(f"`{answer.__name__}` uses `{name}`, a lambda: write it with `def`")
            collect(inspect.unwrap(value), answer, imports, sources, seen)
        elif isinstance(value, PLAIN_VALUES):
            imports.append(f"{name} = {value!r}")
        elif importable(value):
            imports.append(f"from {value.__module__} import {value.__qualname__} as {name}")
        else:
            raise NotTransferable(
                f"`{answer.__name__}` uses `{name}`, a {type(value).__name__} of this notebook, which the check's "
                f"processes cannot see: make it an argument, or build it inside the function")
    if function.__code__.co_freevars:  # a closure: its source alone cannot rebuild it
        raise NotTransferable(f"`{function.__name__}` is defined inside another function: define it at the top level")
    sources.append(source)


def global_names(code):
    """The global names ``code`` and the functions nested in it read (not attribute names)."""
    names = {instruction.argval for instruction in dis.get_instructions(code)
             if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= global_names(constant)
    return names


def decorator_names(source):
    """The names the decorator lines use (``@torch.no_grad()``: torch): they run when the module is loaded."""
    definition = ast.parse(source).body[0]
    return {node.id for decorator in definition.decorator_list for node in ast.walk(decorator)
            if isinstance(node, ast.Name)}


def written_alongside(value, function):
    """A function of the same notebook (or module) as the answer: its source goes along."""
    return inspect.isfunction(value) and value.__globals__ is function.__globals__


def importable(value):
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not module or "." in qualname or module == "__main__":
        return False
    try:
        return getattr(sys.modules.get(module) or __import__(module, fromlist=[qualname]), qualname) is value
    except (ImportError, AttributeError):
        return False


# ---------------------------------------------------------------- what the worker processes use

@contextlib.contextmanager
def replaced(answer, replacements):
    """Each ``(module, name): value`` of ``replacements`` set for the block, also where the answer's functions hold
    the same object under a name of their own (``from torch.distributed import barrier``); all put back after.
    The rank checks watch or steer the participant's calls this way."""
    namespaces = {id(f.__globals__): f.__globals__ for f in vars(answer).values() if inspect.isfunction(f)}
    originals = {key: getattr(*key) for key in replacements}
    imported = [(namespace, name, value, replacements[key]) for namespace in namespaces.values()
                for name, value in list(namespace.items()) for key, original in originals.items()
                if value is original]
    try:
        for (module, name), value in replacements.items():
            setattr(module, name, value)
        for namespace, name, _, value in imported:
            namespace[name] = value
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)
        for namespace, name, original, _ in imported:
            namespace[name] = original


def load_answer(path):
    """The answer module written by ``module_source``, as a namespace."""
    namespace = {"__name__": "answer"}
    source = Path(path).read_text()
    exec(compile(source, str(path), "exec"), namespace)
    return types.SimpleNamespace(**namespace)
