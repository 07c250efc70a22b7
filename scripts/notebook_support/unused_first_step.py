"""Notebook 04, section 5.2: what the first step does when a parameter gets no gradient. Notebook support: a
learner may skip this module.

    torchrun --nproc-per-node=2 scripts/notebook_support/unused_first_step.py [--json FILE]

With find_unused_parameters=False, step 1 holds every parameter in one bucket, and head_b's gradients never
arrive, so that bucket is never all-reduced: backward returns with each rank's own gradients, and an optimizer
step would move the replicas apart before step 2 raises. With find_unused_parameters=True the same step
averages. Rank 0 prints how far the ranks' gradients are apart after step 1's backward, for both. The point
holds for every backend, so this runs on the CPU with gloo.
"""
import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 (before the group exists: scripts/kit/launch_checks.py says why)
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(nn.Module):
    """scripts/demos/ddp_mechanics.py's model: a shared body and two heads; forward uses head_a only."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head_a = nn.Linear(8, 2)
        self.head_b = nn.Linear(8, 2)

    def forward(self, x):
        return self.head_a(F.relu(self.body(x)))


def largest_difference_from_rank0(tensors):
    """How far this rank's tensors are from rank 0's, as the maximum over every rank (a collective)."""
    mine = torch.cat([t.detach().reshape(-1) for t in tensors])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    largest = (mine - rank0).abs().max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def gradient_spread_after_step1(seed, find_unused_parameters):
    """The largest difference between the ranks' gradients after one forward and backward, each rank on its
    own data (the parameters that got a gradient)."""
    torch.manual_seed(seed)
    model = DDP(TwoHeads(), find_unused_parameters=find_unused_parameters)  # rank 0's weights everywhere
    torch.manual_seed(seed + 1 + dist.get_rank())  # each rank its own data, as in training
    model(torch.randn(8, 4)).sum().backward()
    return largest_difference_from_rank0(p.grad for p in model.parameters() if p.grad is not None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the two spreads here (rank 0)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    spreads = {}
    for find in (False, True):
        spread = spreads[f"find_unused_parameters={find}"] = gradient_spread_after_step1(args.seed, find)
        if dist.get_rank() == 0:
            print(f"find_unused_parameters={find!s:<5}: after step 1's backward, the ranks' gradients differ "
                  f"by up to {spread:.1f}", flush=True)
    if args.json and dist.get_rank() == 0:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(spreads, indent=2) + "\n")
    dist.barrier()  # every rank leaves together (demos/runner.py's leave_together says why)
    dist.destroy_process_group()
    gc.collect()  # the DDP models sit in reference cycles that hold the group: free it before the shutdown


if __name__ == "__main__":
    main()
