"""The checks of 09_when_it_hangs.ipynb's exercises: the rank and line a hung job's py-spy dumps single out, and the
rank its log says the others waited for, from two real hung jobs. Notebook support: a learner may skip this module.
"""
import re

from .registry import exercise


def hung_job_evidence(name):
    """A file of notebooks/hung_jobs/: what two real hung jobs left (scripts/demos/record_hung_jobs.py made them)."""
    from kit.output_paths import REPO

    return (REPO / "notebooks" / "hung_jobs" / name).read_text()


def rank_dumps(text):
    """{rank: py-spy dump} from a file of dumps, one section per rank, each under '=== rank N: ...'."""
    parts = re.split(r"^=== rank (\d+): .*===$", text, flags=re.M)
    return {int(rank): dump for rank, dump in zip(parts[1::2], parts[2::2])}


def where_each_rank_waits(dumps):
    """{rank: (the collective, the course's frame that called it)} from each rank's py-spy dump."""
    from ..rank_stacks import main_thread, waiting_collective

    return {rank: waiting_collective(main_thread(dump)) for rank, dump in dumps.items()}


@exercise(1, answers=("odd_rank", "odd_line"))
def check_odd_rank(odd_rank, odd_line, dumps=None):
    from kit.output_paths import REPO

    waits = where_each_rank_waits(rank_dumps(dumps or hung_job_evidence("uneven_3_ranks.pyspy.txt")))
    places = {rank: (collective.function, caller.file, caller.line) for rank, (collective, caller) in waits.items()}
    odd = [rank for rank, place in places.items() if list(places.values()).count(place) == 1]
    assert len(odd) == 1, f"the dumps should show one rank apart from the others: {places}"
    rank, (collective, caller) = odd[0], waits[odd[0]]
    assert odd_rank == rank, (f"odd_rank = {odd_rank}: that rank waits where another one does; compare each rank's "
                              "innermost frames and find the stack no other rank shares")
    assert odd_line == caller.line, (f"odd_line = {odd_line}: in rank {rank}'s dump, take the line of the course's own "
                                     f"frame just under the torch.distributed call ({collective.function})")
    code = (REPO / "scripts" / caller.file).read_text().splitlines()[caller.line - 1].strip()
    others = sorted({f"{place[0]} at {place[1]}:{place[2]}" for other, place in places.items() if other != rank})
    return (f"Rank {rank} waits in {collective.function} at {caller.file}:{caller.line} (`{code}`), the others in "
            f"{' and '.join(others)}: its batches ran out one early, so it reached the end of the epoch while they "
            "wait for a batch it never had. No error names it: every rank just waits, in a different collective. "
            "Give every rank the same number of batches (DistributedSampler pads; drop_last), or use Join.")


@exercise(2, answers=("culprit", "steps_done", "root_cause"))
def check_culprit(culprit, steps_done, root_cause, log=None):
    log = log or hung_job_evidence("uneven_4_ranks.log")
    behind = {(int(rank), int(step)) for rank, step in re.findall(r"rank (\d+) last reported step (\d+)", log)}
    assert len(behind) == 1, f"the log should name one rank behind the others: {behind}"
    (rank, step), = behind
    named = int(re.search(r"Root Cause \(first observed failure\):.*?rank\s+: (\d+)", log, re.S)[1])
    stopped = exit_codes(log, -15)  # SIGTERM: torchrun stopped them
    ended = exit_codes(log, -14)  # SIGALRM: stuck where no step ends, they ended themselves after SIGTERM
    assert culprit == rank, (f"culprit = {culprit}: read the ranks' own error lines; which rank do the others say "
                             "they waited for?")
    assert steps_done == step, f"steps_done = {steps_done}: how many steps had rank {rank} completed, by those lines?"
    assert root_cause == named, (f"root_cause = {root_cause}: which rank does torchrun's summary name under "
                                 "'Root Cause (first observed failure)'?")
    return (f"The others waited for rank {rank}, which had completed {step} steps: it stalled the job. Yet torchrun "
            f"names rank {named} as the root cause: the first process to fail, a rank that waited for rank {rank} and "
            "gave up at --timeout. Rank(s) "
            f"{', '.join(map(str, stopped))} ended with exit code -15 (SIGTERM): torchrun stopped them"
            + (f"; rank(s) {', '.join(map(str, ended))} with -14 (SIGALRM): stuck where no step ends, they ended "
               "themselves 10 s after SIGTERM (notebook 05)" if ended else "")
            + ". Look for the rank the others waited for, not the first one to fail.")


def exit_codes(log, code):
    """The ranks that torchrun's summary lists with exit code ``code``."""
    return sorted(int(r) for r in re.findall(rf"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: {code}\b", log))
