"""What every demo shares: set-up in one call, printing on rank 0, demos run by name from a table,
and leaving together. Demo support: a learner may skip this module.

A demo script lists its demos in a table, ``DEMOS = {"devices": demo_devices, ...}``; ``--demo``
picks some of them by name (``add_demo_arguments``), and ``run_demos`` runs them in order, each
under a ``== name ==`` heading that ``split_sections`` reads back, then writes what they observed
to ``--json`` and has every rank leave together.
"""
import json
from pathlib import Path

import torch
import torch.distributed as dist

from kit import exactness
from lesson import process


def add_demo_arguments(parser, demos, default=None):
    names = list(demos)
    parser.add_argument("--demo", choices=names, nargs="*", default=names if default is None else default,
                        help="which demos to run (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="write what the demos observed here (rank 0)")


def setup(args):
    """Everything a demo needs in one call: exact math, this process, set_device, init and pre-flight.
    The step scripts spell these calls out instead."""
    # The demos compare ranks and runs to 1e-6: on a GPU, TF32 and cuDNN's algorithm choice would move them.
    exactness.exact_math()
    runtime = process.this_process(args)
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)
    dist.init_process_group(runtime.backend, timeout=runtime.timeout)
    process.preflight(runtime)
    torch.manual_seed(args.seed)
    return runtime


def say(runtime, *lines):
    if runtime.is_main:
        print("\n".join(lines), flush=True)


def barrier(runtime):
    if runtime.distributed:
        dist.barrier()


def run_demos(runtime, args, demos):
    """Each demo named in --demo, in order, under a "== name ==" heading; what they observed goes to
    --json; then every rank leaves together."""
    observed = {}
    for name in args.demo:
        say(runtime, f"== {name} ==")
        observed[name] = demos[name](runtime, args)
    if args.json and runtime.is_main:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(observed, indent=2) + "\n")
    leave_together()


def leave_together():
    """The end of a demo: every rank waits for the others (none closes its connections while a
    peer still needs them), then tears the process group down, which joins gloo's worker threads
    when nothing else holds the group (tests/test_teardown.py says why; test_collectives_demo.py,
    test_ddp_demos.py and test_beyond.py check the demos).
    Left running into Python's shutdown, one of them can free a tensor then and abort the process
    ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def split_sections(output):
    """{section name: its text} from a demo's output; '' holds the lines before the first heading."""
    sections, name = {"": []}, ""
    for line in output.splitlines():
        if line.startswith("== ") and line.endswith(" =="):
            name = line[3:-3]
            sections[name] = []
        else:
            sections[name].append(line)
    return {key: "\n".join(lines) for key, lines in sections.items()}


def largest_difference_from_rank0(tensors):
    """How far this rank's tensors are from rank 0's, as the maximum over every rank.

    0.0 means every replica holds exactly rank 0's values: the check that data-parallel
    replicas are still in sync. A collective: every rank must call it.
    """
    mine = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    largest = (mine - rank0).abs().max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()
