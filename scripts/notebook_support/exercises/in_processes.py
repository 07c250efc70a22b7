"""Run a participant's function in real processes, as the exercises that ask for distributed code need. Notebook
support: a learner may skip this module.

A notebook's kernel cannot hand a function to other processes (notebook 00 shows why mp.spawn fails). So
``run_check`` writes the function's source to a file, with an import line for every module or library name it
uses, and starts ``notebook_support/exercise_worker.py`` under torchrun: 2 gloo processes on this machine. Each
process loads the file and runs the exercise's *rank check*, a function of the exercise's module that calls the
participant's code with the real torch.distributed and says in one line what is wrong, with a hint. Each rank
writes its verdict to a file; the kernel reads them. A rank waiting in a collective that another rank never calls
fails after ``TIMEOUT_SECONDS``, the process group's timeout; a rank whose code never returns is ended after
``ANSWER_SECONDS`` by the worker, with a verdict that says so.

``verdicts`` runs several answers in one torchrun, one after another in the same process group: the tests use
it to run the solution and every listed wrong answer at the cost of one start.
"""
import ast
import contextlib
import dis
import inspect
import json
import re
import signal
import sys
import tempfile
import textwrap
import traceback
import types
from pathlib import Path

from notebook_support.runs import torchrun

WORKER = "notebook_support/exercise_worker.py"
TIMEOUT_SECONDS = 30  # the worker's process-group timeout: how long a rank waits for a collective that never comes
ANSWER_SECONDS = 60  # how long one answer may run on a rank before the worker ends it
START_SECONDS = 120  # torchrun and two processes importing torch, on a loaded 2-core machine
HUNG = "your code did not return within"  # the start of the verdict of a rank the worker ended
# What gloo's errors in a collective mean here: another rank called another collective, none, or left. They follow
# from another rank's mistake, which its own verdict names better.
WAITED = "this rank waited {seconds} s in a collective that another rank never called"
LEFT = "this rank was in a collective that another rank left (it returned, raised or ended)"
SAME_COLLECTIVES = ": do all ranks call the same collectives, in the same order?"


class Wrong(AssertionError):
    """A rank check's verdict: what is wrong, with a hint, in one line. A rank check may also raise it from inside
    the participant's call (a replaced function that sees the mistake); a plain AssertionError raised in the
    participant's own code is reported as theirs."""


class NotTransferable(AssertionError):
    """The answer uses a value the worker processes cannot get from its source."""


def run_check(rank_check, nproc=2, **answers):
    """Run ``rank_check`` on ``answers`` (names -> functions) in ``nproc`` gloo processes; return rank 0's detail.
    A wrong answer raises AssertionError with the one-line verdict that explains most (combine)."""
    [(problem, details)] = verdicts(rank_check, [answers], nproc)
    if problem is not None:
        raise AssertionError(problem)
    return details[0]


def verdicts(rank_check, answer_sets, nproc=2, answer_seconds=ANSWER_SECONDS):
    """For each dict of answers: (the first problem any rank found, or None; every rank's detail), from one
    torchrun in which every set runs in turn. A rank that dies, or that the worker ends after ``answer_seconds``,
    leaves the sets after it without a verdict."""
    with tempfile.TemporaryDirectory(prefix="exercise-") as folder:
        folder = Path(folder)
        for number, answers in enumerate(answer_sets):
            (folder / f"answer{number}.py").write_text(module_source(answers))
        check = f"{rank_check.__module__}:{rank_check.__name__}"
        try:
            output = torchrun(WORKER, "--check", check, "--answers", len(answer_sets), "--folder", folder,
                              "--answer-seconds", answer_seconds, nproc=nproc,
                              timeout=START_SECONDS + answer_seconds * len(answer_sets), echo=False)
        except Exception as failure:  # noqa: BLE001 (RunFailed or a timeout: the rank files say what got done)
            output = str(failure)
        ranks = [read_rank(folder, rank) for rank in range(nproc)]
    return [combine(ranks, number, output) for number in range(len(answer_sets))]


def read_rank(folder, rank):
    path = folder / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else []


def combine(ranks, number, output):
    """The first problem by what explains most: a rank whose own code hung or died, then a named mistake or an
    error of the participant's code, then a rank that torchrun stopped because another died, then a collective
    that failed because another rank was elsewhere. And every rank's detail."""
    problems, details = [], []
    for rank, results in enumerate(ranks):
        if number >= len(results):
            ending = how_it_ended(output, rank)
            problems.append((2 if ending == ": killed by SIGTERM" else 0,
                             f"rank {rank} ended before its verdict{ending}"))
            details.append(None)
            continue
        problem, detail = results[number]
        if problem is not None:
            problems.append((priority(problem, rank), problem or "(no message)"))
        details.append(detail)
    return (min(problems, key=lambda p: p[0])[1] if problems else None), details


def priority(problem, rank):
    """0 first: see combine."""
    if problem.startswith(f"rank {rank}: {HUNG}"):
        return 0
    if SAME_COLLECTIVES in problem:
        return 3
    return 1


def how_it_ended(output, rank):
    """': killed by SIGSEGV' or ': exit code 1', from torchrun's summary of the failed run; else its last error."""
    ended = re.search(rf"^\s*rank\s*:\s*{rank} \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output, re.M)
    if ended:
        code = int(ended[1])
        if code >= 0:
            return f": exit code {code}"
        return f": killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f": signal {-code}"
    return f"; the run ended with: {last_error(output)}"


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
    if function.__code__.co_freevars:  # a closure: its source alone cannot rebuild it
        raise NotTransferable(f"`{answer.__name__}` is built inside another function (a def inside a def, or a "
                              "decorator without functools.wraps): write it at the top level of the cell")
    source = textwrap.dedent(inspect.getsource(function))
    for name in sorted(global_names(function.__code__) | signature_names(source)):
        if name not in function.__globals__ or not name.isidentifier():
            continue  # a builtin, a name the worker reports as undefined, or pytest's rewriting of an assert
        value = function.__globals__[name]
        if isinstance(value, types.ModuleType):
            imports.append(f"import {value.__name__} as {name}" if value.__name__ != name else f"import {name}")
        elif written_alongside(inspect.unwrap(value) if callable(value) else value, function):
            if value.__name__ == "<lambda>":
                raise NotTransferable(f"`{answer.__name__}` uses `{name}`, a lambda: write it with `def`")
            collect(inspect.unwrap(value), answer, imports, sources, seen)
        elif (line := constant_line(name, value)) is not None:
            imports.append(line)
        elif importable(value):
            imports.append(f"from {value.__module__} import {value.__qualname__} as {name}")
        else:
            raise NotTransferable(
                f"`{answer.__name__}` uses `{name}`, a {type(value).__name__} of this notebook, which the check's "
                f"processes cannot see: build it inside the function")
    sources.append(source)


def constant_line(name, value):
    """``name = ...`` for a value written as Python (numbers, strings, tuples, lists and dicts of them), a torch
    dtype or a ReduceOp; None for anything else."""
    import torch
    import torch.distributed as dist

    if isinstance(value, torch.dtype):
        return f"import torch\n{name} = {value}"  # its repr: torch.bfloat16
    if isinstance(value, dist.ReduceOp.RedOpType):
        return f"import torch.distributed\n{name} = torch.distributed.ReduceOp.{value.name}"
    try:
        same = ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return f"{name} = {value!r}" if same else None


def global_names(code):
    """The global names ``code`` and the functions nested in it read (not attribute names)."""
    names = {instruction.argval for instruction in dis.get_instructions(code)
             if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= global_names(constant)
    return names


def signature_names(source):
    """The names the def line itself uses, which run when the module is loaded: the decorators
    (``@torch.no_grad()``: torch), the default values and the annotations."""
    definition = ast.parse(source).body[0]
    arguments = definition.args
    annotated = [argument.annotation for argument in (*arguments.posonlyargs, *arguments.args,
                                                      *arguments.kwonlyargs, arguments.vararg, arguments.kwarg)
                 if argument is not None and argument.annotation is not None]
    parts = [*definition.decorator_list, *arguments.defaults, *filter(None, arguments.kw_defaults), *annotated,
             *filter(None, [definition.returns])]
    return {node.id for part in parts for node in ast.walk(part) if isinstance(node, ast.Name)}


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


ANSWER_FILES = set()  # in a worker process: the answer files loaded, to tell the participant's frames from the check's


def load_answer(path):
    """The answer module written by ``module_source``, as a namespace."""
    namespace = {"__name__": "answer"}
    source = Path(path).read_text()
    ANSWER_FILES.add(str(path))
    exec(compile(source, str(path), "exec"), namespace)
    return types.SimpleNamespace(**namespace)


def frames_of_the_answer(error):
    """The frames of ``error``'s traceback that are the participant's code."""
    return [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename in ANSWER_FILES]


def raised_line(error, rank):
    """'rank 1: your code raised RuntimeError at `dist.all_gather(out, t)`: ...', the message's first line; gloo's
    errors of a collective that another rank never called, or left, said in words."""
    yours = frames_of_the_answer(error)
    where = f" at `{yours[-1].line}`" if yours and yours[-1].line else ""
    message = (str(error).strip().splitlines() or [""])[0]
    if re.search(r"[Tt]imed out", message):
        message = WAITED.format(seconds=TIMEOUT_SECONDS) + SAME_COLLECTIVES
    elif re.search(r"Connection (closed|reset) by peer", message):
        message = LEFT + SAME_COLLECTIVES
    return f"rank {rank}: your code raised {type(error).__name__}{where}: {message}"
