"""What DistributedDataParallel does for you, and where it bites: small demos, one run.

    torchrun --nproc-per-node=2 scripts/demos/ddp_mechanics.py

Each demo prints a section headed ``== name ==`` on rank 0 (the notebook shows each
section where it belongs), and ``--json`` writes what was observed, for checks:

  devices    which device each rank uses: cuda:LOCAL_RANK, never cuda:RANK
  broadcast  ranks built with different weights hold rank 0's after DDP(model)
  buckets    the order of events in backward: gradients arrive, buckets are all-reduced
  buffers    BatchNorm: each rank normalises with its own batch; the running statistics
             (buffers) are rank 0's, broadcast at the start of every forward
  unused     a parameter that gets no gradient: step 1 averages nothing, step 2 raises; then
             find_unused_parameters
  prefix     a DDP state_dict has "module." keys; a plain model loads model.module's
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

from demos import runner
from demos.runner import say
from kit import agreement
from lesson import models
from machinery import cli


def add_arguments(parser):
    runner.add_demo_arguments(parser, DEMOS)
    parser.add_argument("--save-prefixed", type=Path, default=None,
                        help="rank 0 also saves ddp_model.state_dict() here, 'module.' keys and all (the mistake)")
    parser.set_defaults(dropout=False)


def wrap(model, runtime, **options):
    """DDP as the training script builds it: device_ids only for a GPU."""
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DDP(model.to(runtime.device), device_ids=device_ids, **options)


def demo_devices(runtime, args):
    """Each process takes the GPU numbered by its LOCAL rank (set_device before init)."""
    mine = {"rank": runtime.rank, "local_rank": runtime.local_rank, "device": str(runtime.device)}
    if runtime.device.type == "cuda":
        mine["current_cuda_device"] = torch.cuda.current_device()
    everyone = agreement.gather_from_all_ranks(mine)
    say(runtime, *(f"rank {r['rank']}: local rank {r['local_rank']}, device {r['device']}"
                   + (f", torch.cuda.current_device() = {r['current_cuda_device']}"
                      if "current_cuda_device" in r else "")
                   for r in everyone))
    return everyone


def demo_broadcast(runtime, args):
    """DDP's constructor copies rank 0's parameters and buffers to every rank."""
    torch.manual_seed(args.seed + runtime.rank)  # a different initialisation on every rank, on purpose
    model = models.Net(dropout=False).to(runtime.device)
    before = runner.largest_difference_from_rank0(model.parameters())
    model = wrap(model, runtime)
    after = runner.largest_difference_from_rank0(model.parameters())
    say(runtime, f"before DDP(model): largest weight difference between ranks {before:.4f}",
        f"after  DDP(model): largest weight difference between ranks {after:.4f}")
    return {"before": before, "after": after}


def demo_buckets(runtime, args):
    """Record, in order, when each gradient is computed and when each bucket is all-reduced."""
    torch.manual_seed(args.seed)
    model = models.Net(dropout=False).to(runtime.device)
    names = {id(param): name for name, param in model.named_parameters()}
    events = []
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: events.append(f"  gradient ready: {name}"))
    model = wrap(model, runtime)

    bucket_numels = []

    def logged_allreduce(state, bucket):
        """Note the bucket, then do exactly what DDP does by default: average it with all_reduce."""
        members = ", ".join(names[id(p)] for p in bucket.parameters())
        numbers = bucket.buffer().numel()
        bucket_numels[-1].append(numbers)
        events.append(f"  -> all_reduce of bucket {bucket.index()} started ({numbers:,} numbers: {members})")
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, logged_allreduce)
    torch.manual_seed(args.seed + 1 + runtime.rank)  # each rank its own data
    images = torch.randn(16, 1, 28, 28, device=runtime.device)
    labels = torch.randint(0, 10, (16,), device=runtime.device)
    steps = []
    for step in (1, 2):
        events.clear()
        bucket_numels.append([])
        F.cross_entropy(model(images), labels).backward()
        events.append("  backward() returned")
        steps.append(list(events))
        say(runtime, f"step {step}:", *events)
    grads_equal = runner.largest_difference_from_rank0(p.grad for p in model.parameters())
    say(runtime, f"after backward, largest gradient difference between ranks: {grads_equal:.1e}")
    return {"steps": steps, "bucket_numels": bucket_numels, "gradient_spread": grads_equal,
            "parameter_numels": {name: p.numel() for name, p in model.module.named_parameters()},
            "explicit_cap_25_numels": rebuilt_bucket_numels(runtime, args, bucket_cap_mb=25)}


def rebuilt_bucket_numels(runtime, args, **options):
    """The bucket sizes (in numbers) DDP uses from step 2 on, for these DDP options."""
    torch.manual_seed(args.seed)
    model = wrap(models.Net(dropout=False), runtime, **options)
    numels = []

    def note(state, bucket):
        numels.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, note)
    images = torch.randn(4, 1, 28, 28, device=runtime.device)
    for _ in range(2):
        numels.clear()
        model(images).sum().backward()
    return numels


def demo_buffers(runtime, args):
    """BatchNorm in DDP: each rank normalises with its own batch; running statistics come from rank 0.

    In training, BatchNorm normalises with the mean and variance of the batch it sees, and
    DDP does not change that: each rank uses its own shard's. Its running statistics (used
    in evaluation) are buffers, which DDP broadcasts from rank 0 at the start of every forward.
    """
    observed, lines = {}, []
    for sync in (True, False):
        torch.manual_seed(args.seed)
        model = wrap(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)), runtime,
                     forward_sync_buffers=sync)
        batchnorm = model.module[1]
        at_start = []  # how far apart the ranks' running means are as each forward starts
        batch_stats = []  # per step: this rank's per-feature batch means of BatchNorm's input and output

        def record(module, inputs, at_start=at_start):
            at_start.append(runner.largest_difference_from_rank0([module.running_mean]))

        def normalised(module, inputs, output, batch_stats=batch_stats):
            batch_stats.append((inputs[0].detach().mean(dim=0), output.detach().mean(dim=0)))

        batchnorm.register_forward_pre_hook(record)
        batchnorm.register_forward_hook(normalised)
        torch.manual_seed(args.seed + 1 + runtime.rank)  # each rank its own data, so its own statistics
        for _ in range(2):
            model(torch.randn(32, 4, device=runtime.device) + runtime.rank).sum().backward()
        observed[f"forward_sync_buffers={sync}"] = at_start
        if sync:
            input_means, output_means = batch_stats[0]
            input_gap = runner.largest_difference_from_rank0([input_means])
            output_mean = max(agreement.gather_from_all_ranks(output_means.abs().max().item()))
            observed["training"] = {"input_mean_gap": input_gap, "largest_output_mean": output_mean}
            lines += [f"training step 1: the per-feature means of BatchNorm's input differ between the ranks "
                      f"by up to {input_gap:.2f},",
                      f"  yet on every rank its output has per-feature mean {output_mean:.4f}: "
                      "each rank normalised with its own batch's statistics"]
        lines.append(f"forward_sync_buffers={sync!s:<5}: ranks' running_mean differ by "
                     f"{at_start[0]:.4f} when step 1's forward starts, by {at_start[1]:.4f} when step 2's starts")
    say(runtime, *lines)
    return observed


class TwoHeads(nn.Module):
    """A shared body and two heads; this forward uses head_a only, so head_b gets no gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head_a = nn.Linear(8, 2)
        self.head_b = nn.Linear(8, 2)

    def forward(self, x, head="a"):
        hidden = F.relu(self.body(x))
        return self.head_a(hidden) if head == "a" else self.head_b(hidden)


def train_steps(model, runtime, steps=3):
    """Forward and backward on random data; returns how many steps completed."""
    for step in range(steps):
        try:
            model(torch.randn(8, 4, device=runtime.device)).sum().backward()
        except RuntimeError as error:
            return step, str(error)
    return steps, None


def gradient_spread_after_step1(runtime, seed, **options):
    """How far apart the ranks' gradients are after the first backward, each rank on its own data (the parameters
    that got a gradient): with find_unused_parameters=False, step 1's single bucket waits for head_b and is never
    all-reduced."""
    torch.manual_seed(seed)
    model = wrap(TwoHeads(), runtime, **options)  # rank 0's weights everywhere
    torch.manual_seed(seed + 1 + runtime.rank)  # each rank its own data, as in training
    model(torch.randn(8, 4, device=runtime.device)).sum().backward()
    return runner.largest_difference_from_rank0(p.grad for p in model.parameters() if p.grad is not None)


def demo_unused(runtime, args):
    spread = {f"find_unused_parameters={find}": gradient_spread_after_step1(runtime, args.seed,
                                                                            find_unused_parameters=find)
              for find in (False, True)}
    torch.manual_seed(args.seed)
    names = [name for name, _ in TwoHeads().named_parameters()]
    done, error = train_steps(wrap(TwoHeads(), runtime), runtime)
    result = {"default_steps": done, "error": error}
    lines = [f"find_unused_parameters=False: {done} step(s) done, then:"]
    if error:
        first = error.split(". ")[0]
        indices = next((line.split(":")[-1].split() for line in error.splitlines() if "did not receive grad" in line),
                       [])
        result["unused"] = [names[int(i)] for i in indices]
        lines += [f"  RuntimeError: {first}.",
                  f"  parameter indices that got no gradient: {' '.join(indices)} = {', '.join(result['unused'])}"]
    done, error = train_steps(wrap(TwoHeads(), runtime, find_unused_parameters=True), runtime)
    result["fixed_steps"], result["fixed_error"] = done, error
    result["gradient_spread_after_step1"] = spread
    lines.append(f"find_unused_parameters=True:  {done} step(s) done" + (f", then: {error}" if error else ", no error"))
    say(runtime, *lines)
    return result


def demo_prefix(runtime, args):
    torch.manual_seed(args.seed)
    model = wrap(models.Net(dropout=False), runtime)
    wrapped_keys = list(model.state_dict())
    plain = models.Net(dropout=False)
    try:
        plain.load_state_dict(model.state_dict())
        wrong = "loaded (unexpected)"
    except RuntimeError as error:
        wrong = "RuntimeError: " + " ".join(str(error).split())[:110] + " ..."
    right = str(plain.load_state_dict(model.module.state_dict()))
    state = model.state_dict()
    consume_prefix_in_state_dict_if_present(state, "module.")
    stripped = str(plain.load_state_dict(state))
    if args.save_prefixed and runtime.is_main:
        args.save_prefixed.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.save_prefixed)
    runner.barrier(runtime)  # nobody reads the file before rank 0 has written it
    say(runtime, f"keys of ddp_model.state_dict():        {wrapped_keys[:3]} ...",
        f"keys of ddp_model.module.state_dict(): {list(model.module.state_dict())[:3]} ...",
        f"plain Net loads ddp_model.state_dict():        {wrong}",
        f"plain Net loads ddp_model.module.state_dict(): {right}",
        f"plain Net loads it after consume_prefix_in_state_dict_if_present(state, 'module.'): {stripped}")
    return {"wrapped_keys": wrapped_keys, "wrong": wrong, "right": right, "stripped": stripped}


DEMOS = {"devices": demo_devices, "broadcast": demo_broadcast, "buckets": demo_buckets, "buffers": demo_buffers,
         "unused": demo_unused, "prefix": demo_prefix}


def main(args):
    runner.run_demos(runner.setup(args), args, DEMOS)


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)
