"""How a participant's function reaches the processes of an exercise's check: as source, with an import line for
each module or library name it uses (notebook_support.exercises.in_processes.module_source). In-process tests of
the transfer, and one end to end from a Jupyter kernel, where the function is written in a cell."""
import math
import os
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from jupyter_client.manager import start_new_kernel
from torch.utils.data.distributed import DistributedSampler

from helpers import REPO
from notebook_support.exercises import EXERCISES, in_processes
from notebook_support.exercises.in_processes import NotTransferable, load_answer, module_source, replaced

STEPS = 3
WEIGHTS = torch.ones(3)


def helper(x):
    return x + STEPS


def answer(x):
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
    return helper(x) * math.sqrt(4) + len(list(sampler)) + torch.zeros(1).item() + (dist.is_available() - 1)


@torch.no_grad()
def decorated_helper(x):
    return x * 2


@torch.inference_mode()
def decorated(x):
    return decorated_helper(torch.ones(1, requires_grad=True) * x).requires_grad


PREFIXES = ("layer4.", "fc.")
HALF = torch.bfloat16
LARGEST = dist.ReduceOp.MAX


def uses_constants(name, dtype=HALF) -> bool:
    return name.startswith(PREFIXES) and dtype is torch.bfloat16 and LARGEST == dist.ReduceOp.MAX


def uses_a_tensor_of_the_notebook(x):
    return WEIGHTS * x


def test_the_source_carries_its_imports_helpers_and_plain_values(tmp_path):
    path = tmp_path / "answer.py"
    path.write_text(module_source({"renamed": answer}))
    loaded = load_answer(path)
    assert loaded.renamed(1) == answer(1) == (1 + 3) * 2 + 5
    source = path.read_text()
    assert "import torch.distributed as dist" in source and "STEPS = 3" in source
    assert "from torch.utils.data.distributed import DistributedSampler as DistributedSampler" in source
    assert "def helper(x):" in source and "renamed = answer" in source


def test_constants_written_as_python_dtypes_and_reduce_ops_travel_too(tmp_path):
    path = tmp_path / "answer.py"
    path.write_text(module_source({"answer": uses_constants}))
    loaded = load_answer(path)
    assert loaded.answer("fc.weight") and not loaded.answer("conv1.weight")


def test_a_decorated_function_keeps_its_decorators(tmp_path):
    path = tmp_path / "answer.py"
    path.write_text(module_source({"answer": decorated}))
    assert load_answer(path).answer(3) is False and "@torch.no_grad()" in path.read_text()


def test_a_rank_check_replaces_a_function_also_where_the_answer_imported_it_by_name(tmp_path):
    path = tmp_path / "answer.py"
    path.write_text("import time\nfrom time import perf_counter as clock\n\n\n"
                    "def answer():\n    return time.perf_counter(), clock()\n")
    loaded = load_answer(path)
    with replaced(loaded, {(time, "perf_counter"): lambda: 7.0}):
        assert loaded.answer() == (7.0, 7.0)
    assert 7.0 not in loaded.answer()  # both put back


def test_a_value_the_processes_cannot_rebuild_is_named_in_one_line():
    with pytest.raises(NotTransferable, match="uses `WEIGHTS`, a Tensor of this notebook, which the check's "
                                              "processes cannot see: build it inside the function"):
        module_source({"answer": uses_a_tensor_of_the_notebook})
    with pytest.raises(NotTransferable, match="must be a function written with `def`"):
        module_source({"answer": lambda x: x})


def hangs_on_rank_1(model, images_here):
    while dist.get_rank() == 1:
        pass


def asserts(model, images_here):
    assert images_here > 100


def only_rank_0_reduces(model, images_here):
    if dist.get_rank() == 0:
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)


def dies_on_rank_1(model, images_here):
    if dist.get_rank() == 1:
        os._exit(7)


@pytest.mark.slow  # two torchruns of 2 processes
def test_an_answer_that_asserts_hangs_or_dies_gets_one_line_naming_the_rank():
    """A participant's own assert is theirs, not the check's verdict; a rank whose code never returns is ended
    by the worker (here after 3 s), and one that dies is named with its exit code."""
    check = EXERCISES["02.3"].rank_check
    (asserted, _), (hung, _) = in_processes.verdicts(
        check, [{"average_gradients": asserts}, {"average_gradients": hangs_on_rank_1}], answer_seconds=3)
    assert asserted == "rank 0: your code raised AssertionError at `assert images_here > 100`: "
    assert hung.startswith("rank 1: your code did not return within 3 s")
    [(died, _)] = in_processes.verdicts(check, [{"average_gradients": dies_on_rank_1}], answer_seconds=3)
    assert died == "rank 1 ended before its verdict: exit code 7"


@pytest.mark.slow  # one torchrun of 2 processes
def test_the_rank_whose_mistake_explains_the_other_ranks_error_is_the_one_named():
    """Only rank 0 calls all_reduce: rank 0's collective fails because rank 1 is elsewhere (gloo's "Connection
    closed by peer" or a timeout), and rank 1's named verdict, which says what to do, is the one shown."""
    [(problem, _)] = in_processes.verdicts(EXERCISES["02.3"].rank_check, [{"average_gradients": only_rank_0_reduces}])
    assert problem.startswith("rank 1: this rank's gradient is unchanged: all_reduce the gradients")


@pytest.mark.slow  # a kernel, and one torchrun of 2 processes per check
def test_a_function_written_in_a_notebook_cell_is_what_the_check_runs(tmp_path):
    """The participant's cell, as in notebook 02: the right answer passes, and a wrong one (no weighting) fails with
    its hint, each checked in 2 processes started from the kernel."""
    right = (REPO / "notebooks" / "solutions" / "02_ex3.py").read_text()
    wrong = textwrap.dedent("""
        import torch.distributed as dist


        def average_gradients(model, images_here):
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= dist.get_world_size()
        """)
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(REPO / "notebooks"))
    try:
        def run(code):
            output = []

            def keep(message):
                content = message["content"]
                output.append(content.get("text", "") + " ".join(content.get("traceback", [])))

            client.execute_interactive(code, output_hook=keep, timeout=300)
            return "".join(output)

        run("import sys; sys.path.insert(0, '../scripts'); from notebook_support import exercises")
        run(right)
        assert "Exercise 3: correct." in run("exercises.check_uneven_average(average_gradients)")
        run(wrong)
        failed = run("exercises.check_uneven_average(average_gradients)")
        assert "AssertionError" in failed and "plain mean of the ranks' gradients" in failed
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
