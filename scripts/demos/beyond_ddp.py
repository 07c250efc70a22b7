"""Beyond the defaults: what a real data-parallel job adds, each in a small demo, one run.

    torchrun --nproc-per-node=2 scripts/demos/beyond_ddp.py
    torchrun --nproc-per-node=2 scripts/demos/beyond_ddp.py --demo no-join --timeout 5   # ends in an error, on purpose

Each demo prints a section headed ``== name ==`` on rank 0, and ``--json`` writes what was
observed, for checks:

  overlap     the order of events in backward for the hand-written averaging (step2_allreduce.py):
              after backward (bucket) and during it (overlap, overlap-bucket, step2b_own_ddp.py);
              all_reduces per step, and whether one started before the last gradient was computed
  accumulate  gradient accumulation with DDP: K micro-batches with no_sync equal one step on
              the K-times larger batch, with one gradient sync per optimizer step; without
              no_sync the same numbers cost K syncs
  syncbn      the batch statistics of BatchNorm with and without SyncBatchNorm (--sync-bn),
              against one process on the global batch
  join        uneven inputs: ranks with different numbers of batches finish under Join
  no-join     the same without Join: the rank with more batches waits in an all_reduce
              nobody joins, until --timeout ends it with an error (not in the default list)
  zero        ZeroRedundancyOptimizer (ZeRO-1): the optimizer state per rank, against Adam's
  fsdp        fully_shard (FSDP2): parameters and optimizer state per rank, sharded
"""
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import step2b_own_ddp as own_ddp
from demos import runner
from demos.runner import say
from kit import agreement, more_models, sync_batchnorm
from kit.errors import CourseError, first_line
from lesson import models
from machinery import cli
from step2_allreduce import average_gradients_bucket


def add_arguments(parser):
    runner.add_demo_arguments(parser, DEMOS,
                              default=[name for name in DEMOS if name != "no-join"])  # it fails on purpose
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="K, the micro-batches per optimizer step (accumulate)")
    parser.set_defaults(dropout=False, batch_size=16)


def wrap_ddp(model, runtime):
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DDP(model.to(runtime.device), device_ids=device_ids)


def fresh_net(args, runtime, cls=models.Net):
    torch.manual_seed(args.seed)  # the same weights on every rank and in every copy
    return cls(dropout=False).to(runtime.device)


def global_batch(size, runtime, seed):
    """The same random batch on every rank (each rank then takes its shard of it)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (size,), generator=generator)
    return images.to(runtime.device), labels.to(runtime.device)


def shard(tensor, runtime):
    """This rank's contiguous share of a global batch."""
    return tensor.chunk(runtime.world_size)[runtime.rank]


def largest_difference(model_a, model_b):
    pairs = zip(model_a.parameters(), model_b.parameters())
    return max((a.detach() - b.detach()).abs().max().item() for a, b in pairs)


# ---------------------------------------------------------------- overlap

@contextlib.contextmanager
def recording_all_reduces(events):
    """Note every all_reduce this process starts, in the order it starts them."""
    original = dist.all_reduce

    def recorded(tensor, *args, **kwargs):
        events.append(f"  -> all_reduce started ({tensor.numel():,} numbers)")
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recorded
    try:
        yield
    finally:
        dist.all_reduce = original


def demo_overlap(runtime, args):
    """When do the all_reduces start: after backward (step 2) or during it (step 2b)?"""
    images, labels = global_batch(args.batch_size * runtime.world_size, runtime, args.seed + 1)
    images, labels = shard(images, runtime), shard(labels, runtime)
    observed = {}
    for mode in ["bucket", "overlap", "overlap-bucket"]:
        model = fresh_net(args, runtime)
        events = []
        for name, param in model.named_parameters():  # registered first: runs before the wrapper's hook
            param.register_post_accumulate_grad_hook(
                lambda p, name=name, events=events: events.append(f"  gradient ready: {name}"))
        if mode == "bucket":
            def average(model=model):
                return average_gradients_bucket(model)
        else:
            model = own_ddp.wrap(model, mode)
            average = model.finish_gradient_sync
        steps = []
        for _ in range(2):
            events.clear()
            model.zero_grad(set_to_none=True)
            with recording_all_reduces(events):
                F.cross_entropy(model(images), labels).backward()
                events.append("  backward() returned")
                average()
            steps.append(list(events))
        started = [i for i, event in enumerate(steps[-1]) if "all_reduce started" in event]
        last_gradient = max(i for i, event in enumerate(steps[-1]) if "gradient ready" in event)
        observed[mode] = {"events": steps[-1],
                          "all_reduces_per_step": [sum("all_reduce" in e for e in s) for s in steps],
                          "started_before_last_gradient": sum(i < last_gradient for i in started),
                          "gradient_spread": runner.largest_difference_from_rank0(
                              p.grad for p in models.unwrap(model).parameters())}
        say(runtime, f"--mode {mode}, step 2:", *steps[-1],
            f"  {len(started)} all_reduce(s) this step, {observed[mode]['started_before_last_gradient']} of them "
            f"started before the last gradient was computed")
    return observed


# ---------------------------------------------------------------- accumulate

def counting_sync_hook(counts):
    """A DDP communication hook that counts bucket all_reduces and their numbers, then does
    exactly what DDP does by default."""
    def hook(state, bucket):
        counts["all_reduces"] += 1
        counts["syncs"] += bucket.is_last()  # one per backward that synchronises, however many buckets
        counts["numbers"] += bucket.buffer().numel()
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def accumulate_with_ddp(model, optimizer, micro_batches, use_no_sync):
    """One optimizer step over K micro-batches, the gradients summed in .grad."""
    optimizer.zero_grad(set_to_none=True)
    for index, (images, labels) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        skip = model.no_sync() if use_no_sync and not last else contextlib.nullcontext()
        with skip:  # inside no_sync, backward only adds to .grad: no all_reduce
            loss = F.cross_entropy(model(images), labels) / len(micro_batches)
            loss.backward()
    optimizer.step()


def demo_accumulate(runtime, args):
    """K micro-batches of B per rank, with and without no_sync, against one step on W x K x B."""
    k, b, steps = args.micro_batches, args.batch_size, 3

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    single = fresh_net(args, runtime)
    single_optimizer = sgd(single)
    runs = {}
    for name, use_no_sync in [("no_sync", True), ("without no_sync", False)]:
        model = wrap_ddp(fresh_net(args, runtime), runtime)
        counts = {"all_reduces": 0, "syncs": 0, "numbers": 0}
        model.register_comm_hook(None, counting_sync_hook(counts))
        runs[name] = (model, sgd(model), counts, [])
    for step in range(steps):
        images, labels = global_batch(runtime.world_size * k * b, runtime, args.seed + 100 + step)
        single_optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(single(images), labels).backward()  # one process, the whole global batch
        single_optimizer.step()
        mine = list(zip(shard(images, runtime).split(b), shard(labels, runtime).split(b)))
        for model, optimizer, counts, per_step in runs.values():
            before = dict(counts)
            accumulate_with_ddp(model, optimizer, mine, use_no_sync=model is runs["no_sync"][0])
            per_step.append({key: counts[key] - before[key] for key in ("syncs", "all_reduces")})
    observed = {"micro_batches": k, "batch_size": b, "world_size": runtime.world_size, "steps": steps}
    say(runtime, f"{runtime.world_size} ranks x {k} micro-batches of {b}, against one process on batches of "
                 f"{runtime.world_size * k * b}, {steps} SGD steps:")
    for name, (model, _, counts, per_step) in runs.items():
        observed[name] = {"largest_difference": largest_difference(model.module, single),
                          "syncs_per_step": [seen["syncs"] for seen in per_step],
                          "all_reduces_per_step": [seen["all_reduces"] for seen in per_step],
                          "numbers_per_step": counts["numbers"] / steps}
        say(runtime, f"  {name:<16} largest weight difference {observed[name]['largest_difference']:.1e}; "
                     f"gradient syncs per optimizer step {observed[name]['syncs_per_step']} "
                     f"(bucket all_reduces {observed[name]['all_reduces_per_step']}); "
                     f"{observed[name]['numbers_per_step']:,.0f} numbers all-reduced per step")
    return observed


# ---------------------------------------------------------------- SyncBatchNorm

def batch_statistics(model):
    """The mean and variance each BatchNorm layer used in the last forward (momentum None on
    a fresh layer: the running statistics become exactly those of the batch)."""
    return {name: torch.cat([module.running_mean, module.running_var]).detach().clone()
            for name, module in model.named_modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)}


def forward_for_statistics(model, images):
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None
    model.train()
    return model(images)


def demo_syncbn(runtime, args):
    """BatchNorm statistics per rank, with and without SyncBatchNorm, against one process."""
    images, _ = global_batch(args.batch_size * runtime.world_size, runtime, args.seed + 2)
    reference = fresh_net(args, runtime, more_models.NetBN)
    reference_logits = shard(forward_for_statistics(reference, images), runtime)  # one process, global batch
    expected = batch_statistics(reference)
    observed = {}
    for name, model in [("BatchNorm", fresh_net(args, runtime, more_models.NetBN)),
                        ("SyncBatchNorm", sync_batchnorm.convert(fresh_net(args, runtime, more_models.NetBN), "net-bn",
                                                                on_gpu=runtime.device.type == "cuda"))]:
        logits = forward_for_statistics(model, shard(images, runtime))  # this rank: its shard only
        statistics = batch_statistics(model)
        difference = max((statistics[layer] - expected[layer]).abs().max().item() for layer in expected)
        logits_difference = (logits - reference_logits).abs().max().item()
        everyone = agreement.gather_from_all_ranks([difference, logits_difference])
        observed[name] = {"statistics_difference": max(d for d, _ in everyone),
                          "logits_difference": max(d for _, d in everyone)}
        say(runtime, f"{name:<14} largest difference from one process on the global batch: "
                     f"statistics {observed[name]['statistics_difference']:.1e}, "
                     f"outputs {observed[name]['logits_difference']:.1e}")
    torch_own = torch.nn.SyncBatchNorm.convert_sync_batchnorm(fresh_net(args, runtime, more_models.NetBN))
    try:
        torch_own(shard(images, runtime))
        observed["torch_syncbn_on_this_device"] = "ran"
    except ValueError as error:
        observed["torch_syncbn_on_this_device"] = first_line(error)
    say(runtime, f"torch.nn.SyncBatchNorm itself on {runtime.device.type}: {observed['torch_syncbn_on_this_device']}")
    return observed


# ---------------------------------------------------------------- uneven inputs

def uneven_batches(runtime, args):
    """Rank r gets 3 + 2r batches: the ranks run out of data at different steps."""
    count = 3 + 2 * runtime.rank
    images, labels = global_batch(count * args.batch_size, runtime, args.seed + 10 + runtime.rank)
    return list(zip(images.split(args.batch_size), labels.split(args.batch_size)))


def train_uneven(runtime, args, join):
    model = wrap_ddp(fresh_net(args, runtime), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = uneven_batches(runtime, args)
    # Join: a rank that has run out of batches "shadows" the collectives of the others (it
    # all-reduces zeros in their place) until every rank is done.
    with Join([model]) if join else contextlib.nullcontext():
        for images, labels in batches:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
    return model, len(batches)


def demo_join(runtime, args):
    model, mine = train_uneven(runtime, args, join=True)
    counts = agreement.gather_from_all_ranks(mine)
    spread = runner.largest_difference_from_rank0(model.parameters())
    say(runtime, f"batches per rank: {counts}; under Join every rank finished; largest weight difference between "
                 f"ranks: {spread:.1e}")
    return {"batches_per_rank": counts, "weights_spread": spread}


def demo_no_join(runtime, args):
    """The same without Join: the rank with more batches waits in an all_reduce that the
    others never join. A monitored barrier lets the early rank say who is missing; it exists
    for gloo only, so with NCCL it runs in a gloo group of its own."""
    barrier_group = None if runtime.backend == "gloo" else dist.new_group(backend="gloo")  # every rank, up front
    _, mine = train_uneven(runtime, args, join=False)  # the rank with more batches stops in here
    # Half of --timeout: this rank gives up (and says why) before the waiting ranks' own timeout
    # ends them, and before torchrun, seeing one of them fail, stops this one too.
    patience = runtime.timeout / 2
    say(runtime, f"rank {runtime.rank} ran out of batches after {mine} steps; waiting {patience.total_seconds():g} s "
                 f"for the others")
    try:
        dist.monitored_barrier(group=barrier_group, timeout=patience)
    except RuntimeError as error:
        raise CourseError(f"rank {runtime.rank} finished its {mine} batches, but the others never arrived "
                          f"({first_line(error)}): they are still waiting in an all_reduce of a step "
                          f"this rank does not have. Give every rank the same number of batches, or wrap the loop "
                          f"in torch.distributed.algorithms.Join (the join demo)") from None
    return {"batches": mine}


# ---------------------------------------------------------------- when the model does not fit

def state_bytes(optimizer):
    """Bytes of optimizer state this rank holds (Adam: two tensors per parameter it updates)."""
    return sum(local(value).numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value) and value.dim() > 0)


def local(tensor):
    """The part of a tensor this rank stores: an FSDP2 (DTensor) shard, or all of a plain tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train_adam(model, optimizer, runtime, args, steps=3):
    for step in range(steps):
        images, labels = global_batch(args.batch_size * runtime.world_size, runtime, args.seed + 20 + step)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(shard(images, runtime)), shard(labels, runtime)).backward()
        optimizer.step()


def demo_zero(runtime, args):
    """ZeRO-1: each rank keeps the optimizer state of its share of the parameters only."""
    plain = wrap_ddp(fresh_net(args, runtime), runtime)
    adam = torch.optim.Adam(plain.parameters(), lr=1e-3)
    zero_model = wrap_ddp(fresh_net(args, runtime), runtime)
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    train_adam(plain, adam, runtime, args)
    train_adam(zero_model, zero, runtime, args)
    mine = {"adam": state_bytes(adam), "zero": state_bytes(zero.optim),
            "difference": largest_difference(plain.module, zero_model.module),
            "parameters": [name for name, p in zero_model.module.named_parameters()
                           if any(p is q for group in zero.optim.param_groups for q in group["params"])]}
    everyone = agreement.gather_from_all_ranks(mine)
    for rank, seen in enumerate(everyone):
        say(runtime, f"rank {rank}: Adam state {seen['adam'] / 2**20:.2f} MiB; ZeRO-1 {seen['zero'] / 2**20:.2f} MiB "
                     f"(the state of {', '.join(seen['parameters'])})")
    say(runtime, f"largest weight difference, ZeRO-1 against Adam, after 3 steps: "
                 f"{max(seen['difference'] for seen in everyone):.1e}")
    return {"ranks": everyone}


def demo_fsdp(runtime, args):
    """FSDP2: parameters, gradients and optimizer state all sharded; whole weights exist
    only layer by layer, gathered just before they are used."""
    plain = wrap_ddp(fresh_net(args, runtime), runtime)
    adam = torch.optim.Adam(plain.parameters(), lr=1e-3)
    sharded = fresh_net(args, runtime)
    # A process group of its own: torch's DTensor caches keep the group of FSDP2's mesh alive after
    # destroy_process_group, and the default group must go then, joining its gloo threads.
    mesh = DeviceMesh.from_group(dist.new_group(), runtime.device.type)
    for layer in [sharded.conv1, sharded.conv2, sharded.fc1, sharded.fc2]:
        fully_shard(layer, mesh=mesh)  # each layer its own unit: gathered for its forward, freed after
    fully_shard(sharded, mesh=mesh)
    sharded_adam = torch.optim.Adam(sharded.parameters(), lr=1e-3)
    train_adam(plain, adam, runtime, args)
    train_adam(sharded, sharded_adam, runtime, args)
    held = sum(local(p).numel() * p.element_size() for p in sharded.parameters())
    whole = [p.full_tensor() for p in sharded.parameters()]  # a collective: every rank gathers
    difference = max((w - p).abs().max().item() for w, p in zip(whole, plain.module.parameters()))
    mine = {"parameter_bytes": held, "whole_parameter_bytes": sum(p.numel() * p.element_size() for p in whole),
            "adam_state_bytes": state_bytes(sharded_adam), "ddp_adam_state_bytes": state_bytes(adam),
            "difference": difference}
    everyone = agreement.gather_from_all_ranks(mine)
    for rank, seen in enumerate(everyone):
        say(runtime, f"rank {rank}: parameters {seen['parameter_bytes'] / 2**20:.2f} of "
                     f"{seen['whole_parameter_bytes'] / 2**20:.2f} MiB; "
                     f"Adam state {seen['adam_state_bytes'] / 2**20:.2f} "
                     f"MiB (DDP: {seen['ddp_adam_state_bytes'] / 2**20:.2f} MiB)")
    say(runtime, f"largest weight difference, FSDP2 against DDP, after 3 steps: "
                 f"{max(seen['difference'] for seen in everyone):.1e}")
    return {"ranks": everyone}


DEMOS = {"overlap": demo_overlap, "accumulate": demo_accumulate, "syncbn": demo_syncbn, "join": demo_join,
         "no-join": demo_no_join, "zero": demo_zero, "fsdp": demo_fsdp}


def main(args):
    if args.micro_batches < 1:
        raise CourseError("--micro-batches must be 1 or more")
    runtime = runner.setup(args)
    if runtime.world_size < 2:
        raise CourseError("these demos compare ranks: run them with torchrun --nproc-per-node=2 (or more)")
    runner.run_demos(runtime, args, DEMOS)


if __name__ == "__main__":
    cli.run(main, description=__doc__, add_arguments=add_arguments)
