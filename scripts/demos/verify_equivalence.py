"""Check the central claim of the course: data-parallel training on W processes with
batch B each gives the same weights as one process on the global batch W x B.

    torchrun --nproc-per-node=2 scripts/demos/verify_equivalence.py --steps 5 --batch-size 32

From the same initial weights and the same data order, every rank trains:
  single         one process on the whole global batch (each rank runs it locally)
  per-parameter  its shard, gradients averaged with one all_reduce per parameter
  bucket         its shard, gradients averaged with one all_reduce of a flat bucket
  overlap        its shard, one all_reduce per parameter started during backward (step2b_own_ddp.py)
  overlap-bucket its shard, one all_reduce per bucket started during backward (step2b_own_ddp.py)
  ddp            its shard, wrapped in DistributedDataParallel
  no-averaging   its shard, gradients NOT averaged: the control that must differ
Rank 0 prints the largest difference from `single` (gradients after step 1, weights
after every step) and exits with status 1 when an averaged method is off by more
than --tolerance. Dropout is off: its masks would differ between the runs. Each rank first
turns off TF32 and cuDNN's nondeterministic and timed algorithms (kit/exactness.py): on a GPU,
PyTorch's default TF32 convolutions can move the results past 1e-6. --json records each
rank's flags.

The optimizer is Adadelta, the recipe's, by default. With --optimizer adam the
gradients still agree to about 1e-8, but the weights drift apart by about 1e-5 within
a few steps: Adam divides each gradient by the root of its running square, and where a
gradient is close to zero that turns a rounding difference in the sums into a
visible difference in the update. The computation is the same; the optimizer
amplifies its last bits.
"""
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import step2b_own_ddp as own_ddp
from demos import runner
from kit import exactness
from kit.agreement import gather_from_all_ranks
from kit.errors import CourseError
from lesson import data, loop, models
from machinery import cli
from step2_allreduce import average_gradients_bucket, average_gradients_per_parameter

AVERAGED = ["per-parameter", "bucket", "overlap", "overlap-bucket", "ddp"]


def add_arguments(parser):
    parser.add_argument("--steps", type=cli.positive_int, default=5)
    parser.add_argument("--tolerance", type=float, default=1e-6)
    parser.add_argument("--json", type=Path, default=None, help="also write the differences here (rank 0)")
    parser.set_defaults(batch_size=32, dropout=False, optimizer="adadelta")


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def first_batches(dataset, num_replicas, rank, batch_size, steps, args, device):
    """The batches a training script would draw in epoch 1 with this sampler."""
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, seed=args.seed)
    sampler.set_epoch(1)
    batches = data.TensorBatches(dataset, sampler, batch_size, device)
    return [batch for _, batch in zip(range(steps), batches)]


def train(model, batches, args, after_backward=None):
    """Train on the batches; return (gradients after step 1, weights after each step)."""
    optimizer, _ = loop.make_optimizer(model, args)
    first_gradients, weights = None, []
    for images, labels in batches:
        loop.train_step(model, optimizer, images, labels, after_backward)
        if first_gradients is None:
            first_gradients = flat(p.grad for p in model.parameters())
        weights.append(flat(models.unwrap(model).parameters()))
    return first_gradients, weights


def run_all(initial, train_set, runtime, args):
    world, rank, device = runtime.world_size, runtime.rank, runtime.device
    shard = first_batches(train_set, world, rank, args.batch_size, args.steps, args, device)
    global_batches = first_batches(train_set, 1, 0, args.batch_size * world, args.steps, args, device)
    fresh = lambda: copy.deepcopy(initial)  # noqa: E731 -- every method starts from the same weights
    ddp_model = DDP(fresh(), device_ids=[device.index] if device.type == "cuda" else None)
    per_parameter, bucket = fresh(), fresh()
    overlap, overlap_bucket = own_ddp.wrap(fresh(), "overlap"), own_ddp.wrap(fresh(), "overlap-bucket")
    return {
        "single": train(fresh(), global_batches, args),
        "per-parameter": train(per_parameter, shard, args, lambda: average_gradients_per_parameter(per_parameter)),
        "bucket": train(bucket, shard, args, lambda: average_gradients_bucket(bucket)),
        "overlap": train(overlap, shard, args, overlap.finish_gradient_sync),
        "overlap-bucket": train(overlap_bucket, shard, args, overlap_bucket.finish_gradient_sync),
        "ddp": train(ddp_model, shard, args),
        "no-averaging": train(fresh(), shard, args),
    }


def differences(results):
    reference_gradients, reference_weights = results["single"]
    table = {}
    for method, (gradients, weights) in results.items():
        if method == "single":
            continue
        table[method] = {
            "gradient_step1": (gradients - reference_gradients).abs().max().item(),
            "weights_per_step": [(w - r).abs().max().item() for w, r in zip(weights, reference_weights)],
        }
    return table


def report(table, spreads, args, world_size, settings):
    exact = all(exactness.is_exact(one) for one in settings)
    print(f"{'every rank' if exact else 'NOT every rank'}: TF32 off, cuDNN deterministic and not benchmarking "
          "(kit/exactness.py)")
    print(f"max |difference| from one process on the global batch ({world_size} x {args.batch_size}), "
          f"optimizer {args.optimizer}, {args.steps} step(s):")
    print(f"{'method':<15}{'grads, step 1':>15}{'weights, last':>15}{'ranks apart':>13}")
    for method, row in table.items():
        print(f"{method:<15}{row['gradient_step1']:>15.1e}{row['weights_per_step'][-1]:>15.1e}{spreads[method]:>13.1e}")


def main(args):
    runtime = runner.setup(args)  # exactness.exact_math() first: this rank's flags, before its first convolution
    train_set, _ = data.load_datasets(args.dataset, args.data_dir)
    if len(train_set) < args.steps * args.batch_size * runtime.world_size:
        raise CourseError("not enough training samples for that many --steps; lower --steps or --batch-size")
    initial = models.build_model(args).to(runtime.device)
    results = run_all(initial, train_set, runtime, args)
    table = differences(results)
    spreads = {method: runner.largest_difference_from_rank0([results[method][1][-1]]) for method in table}
    worst = max(max(table[m]["gradient_step1"], *table[m]["weights_per_step"], spreads[m]) for m in AVERAGED)
    settings = gather_from_all_ranks(exactness.math_settings())  # as each computing process has them
    if runtime.is_main:
        report(table, spreads, args, runtime.world_size, settings)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"world_size": runtime.world_size, "batch_size": args.batch_size,
                                             "steps": args.steps, "optimizer": args.optimizer,
                                             "differences": table, "ranks_apart": spreads,
                                             "math_settings": settings}, indent=2) + "\n")
    if worst > args.tolerance:
        raise CourseError(f"an averaged method differs by {worst:.1e} > tolerance {args.tolerance:.0e}")
    if runtime.is_main:
        print(f"all averaged methods agree with one process within {args.tolerance:.0e}")


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)
