"""Checks every rank passes or fails together. Kit: a learner may skip this module.

``gather_from_all_ranks`` hands every rank what each rank holds. A check that can fail on one rank only (data missing on
one node, say) is agreed by every rank, so that all of them stop with the same message instead of the healthy ones
waiting for the whole ``--timeout``.
"""
import socket
from contextlib import contextmanager

import torch.distributed as dist

from .errors import CourseError


def gather_from_all_ranks(value):
    """Every rank's ``value`` (any picklable object), as a list indexed by rank, on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@contextmanager
def fail_together(runtime=None):
    """Run a check on every rank; if it fails on any of them, every rank raises the same error.

        with fail_together(runtime):
            train_set, test_set = read_datasets(...)

    Without this, the rank whose check failed exits, and the others wait in their
    next collective for the whole --timeout before they learn anything.
    """
    problem = None
    try:
        yield
    except CourseError as error:
        problem = str(error)
    except OSError as error:
        problem = f"{error.strerror or error}: {error.filename}" if error.filename else str(error)
    problems = gather_from_all_ranks((problem, socket.gethostname()))
    failed = [(rank, text, host) for rank, (text, host) in enumerate(problems) if text]
    if failed:
        rank, text, host = failed[0]
        where = f"rank {rank} ({host}): " if len(problems) > 1 else ""
        others = f" [and on {len(failed) - 1} more rank(s)]" if len(failed) > 1 else ""
        raise CourseError(f"{where}{text}{others}")


def agree(value, view, fix):
    """Every rank must hold the same ``value``; if any differs from rank 0's, every rank raises the same error.

    For what each rank finds on its own and may find differently (files on its own node's disk, say),
    where no rank alone is wrong but the ranks must not go on apart. ``view`` says in words what this rank
    found; the error names the first rank that differs and rank 0, with their views, then ``fix``:

        rank 1 (node-b) sees no checkpoint in ... while rank 0 (node-a) resumes from ...: <fix>
    """
    views = gather_from_all_ranks((value, view, socket.gethostname()))
    differ = [rank for rank, (theirs, _, _) in enumerate(views) if theirs != views[0][0]]
    if differ:
        rank = differ[0]
        others = f" [and {len(differ) - 1} more rank(s)]" if len(differ) > 1 else ""
        raise CourseError(f"rank {rank} ({views[rank][2]}) {views[rank][1]} while rank 0 ({views[0][2]}) "
                          f"{views[0][1]}{others}: {fix}")
