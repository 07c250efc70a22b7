"""Two checkpoint mistakes of distributed training, made on purpose, next to the fix.

    torchrun --nproc-per-node=2 scripts/demos/checkpoint_pitfalls.py --folder checkpoints/pitfalls

Each demo prints a section headed ``== name ==`` on rank 0, and ``--json`` writes what
was observed, for checks:

  every-rank-saves  every rank writes "its" checkpoint to the same path: the file keeps
                    one rank's random state, the others' are lost; the fix gathers
                    every rank's state and rank 0 alone writes
  no-barrier        rank 0 is still writing a new checkpoint when rank 1 reads: rank 1
                    gets the old one; with a barrier between the write and the read,
                    it gets the new one
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch

from demos import runner
from demos.runner import say
from kit import agreement, checkpoints
from machinery import cli

SLOW_WRITE_SECONDS = 1.0  # a large checkpoint on a network file system takes this long, and more


def add_arguments(parser):
    parser.add_argument("--folder", type=Path, required=True, help="where the demos write their files")
    runner.add_demo_arguments(parser, DEMOS)


def my_random_state(runtime, args):
    """This rank's random stream, seeded per rank as the Trainer does (dropout masks differ per rank)."""
    torch.manual_seed(args.seed + runtime.rank)
    return torch.get_rng_state()


def demo_every_rank_saves(runtime, args):
    mine = my_random_state(runtime, args)
    everyone = agreement.gather_from_all_ranks(mine)
    # The mistake: no `if rank == 0`. The ranks take turns here, so that no two writes overlap
    # (overlapping writes to one file can also leave it torn); the last writer still wins.
    wrong = args.folder / "every-rank.pt"
    for turn in range(runtime.world_size):
        if turn == runtime.rank:
            torch.save({"rank": runtime.rank, "rng": mine}, wrong)
        runner.barrier(runtime)
    # The fix, as Checkpointing.write_checkpoint does it: gather every rank's state, rank 0 writes once.
    right = args.folder / "rank0-gathered.pt"
    if runtime.is_main:
        checkpoints.write_atomically({"ranks": [{"rng": state} for state in everyone]}, right)
    runner.barrier(runtime)
    found = {}
    if runtime.is_main:
        saved = torch.load(wrong, map_location="cpu", weights_only=True)
        kept = [rank for rank, state in enumerate(everyone) if torch.equal(state, saved["rng"])]
        gathered = torch.load(right, map_location="cpu", weights_only=True)["ranks"]
        restored = [rank for rank, state in enumerate(everyone) if torch.equal(state, gathered[rank]["rng"])]
        found = {"every_rank_kept": kept, "gathered_restored": restored}
        lost = [rank for rank in range(runtime.world_size) if rank not in kept]
        say(runtime,
            f"every rank saved to one path: the file holds the random state of {len(kept)} of "
            f"{runtime.world_size} ranks; rank(s) {', '.join(map(str, lost))} would resume with another rank's stream",
            f"gathered, then saved by rank 0: the file holds the random state of {len(restored)} of "
            f"{runtime.world_size} ranks, each in its own place")
    return found


def demo_no_barrier(runtime, args):
    path = args.folder / "latest.pt"
    if runtime.is_main:
        checkpoints.write_atomically({"step": torch.tensor(1)}, path)
    runner.barrier(runtime)  # step 1's checkpoint is on disk for everyone

    def rank0_writes_step_2():
        time.sleep(SLOW_WRITE_SECONDS)  # a slow write: a big file, a busy network file system
        checkpoints.write_atomically({"step": torch.tensor(2)}, path)

    def read():
        return int(torch.load(path, map_location="cpu", weights_only=True)["step"])

    # The mistake: rank 1 reads as soon as it gets here.
    if runtime.is_main:
        rank0_writes_step_2()
    without = agreement.gather_from_all_ranks(read())
    # The fix: everyone waits at a barrier until rank 0 has written; then read.
    if runtime.is_main:
        checkpoints.write_atomically({"step": torch.tensor(1)}, path)
    runner.barrier(runtime)
    if runtime.is_main:
        rank0_writes_step_2()
    runner.barrier(runtime)
    with_barrier = agreement.gather_from_all_ranks(read())
    say(runtime,
        f"rank 0 writes step 2's checkpoint ({SLOW_WRITE_SECONDS:.0f} s); the ranks read it:",
        f"  without a barrier: {steps_read(without)}",
        f"  with a barrier:    {steps_read(with_barrier)}")
    return {"without_barrier": without, "with_barrier": with_barrier}


def steps_read(steps):
    return ", ".join(f"rank {rank} read step {step}" for rank, step in enumerate(steps))


DEMOS = {"every-rank-saves": demo_every_rank_saves, "no-barrier": demo_no_barrier}


def main(args):
    runtime = runner.setup(args)
    if runtime.is_main:
        args.folder.mkdir(parents=True, exist_ok=True)
    runner.barrier(runtime)
    runner.run_demos(runtime, args, DEMOS)


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)
