"""The checks of 03_data_parallel.ipynb's exercises: how DataParallel's scatter cuts a batch, the weights its
replicate copies every step, and the participant's DataParallel route (gradients summed on rank 0, one step there,
weights sent back out), run in 2 processes. Notebook support: a learner may skip this module.
"""
import copy
import math

import torch
import torch.distributed as dist

from lesson import models

from . import in_processes
from .gradients import close, flat_gradient
from .registry import exercise


@exercise(1, answers=("sizes_100_on_3", "gpus_working_2_on_4"))
def check_scatter(sizes_100_on_3, gpus_working_2_on_4):
    # DataParallel's scatter cuts the batch with Tensor.chunk (torch/csrc/cuda/comm.cpp, scatter()).
    expected = [len(chunk) for chunk in torch.arange(100).chunk(3)]
    assert list(sizes_100_on_3) == expected, f"{list(sizes_100_on_3)} is not how chunk() cuts 100 samples in 3"
    working = len(torch.arange(2).chunk(4))
    assert gpus_working_2_on_4 == working, f"{gpus_working_2_on_4} GPUs is not how many get a piece of 2 samples"
    return (f"100 samples on 3 GPUs: {expected} (chunk() makes pieces of ceil(100 / 3) = 34 and the last gets "
            f"what is left); 2 samples on 4 GPUs: {working} GPUs work, {4 - working} wait.")


@exercise(2, answers=("per_step", "per_epoch"))
def check_replicate_traffic(per_step, per_epoch, gpus=4, images=60_000, batch_per_gpu=64):
    from lesson.models import Net

    model_bytes = sum(p.numel() * p.element_size() for p in Net().parameters())
    steps = math.ceil(images / (batch_per_gpu * gpus))
    assert per_step == model_bytes * (gpus - 1), (
        f"per_step = {per_step:,} bytes: count one float32 copy of the Net for every GPU that needs one")
    assert per_epoch == per_step * steps, f"per_epoch = {per_epoch:,}: how many steps does one epoch take?"
    return (f"{per_step / 1e6:.1f} MB of weights reach GPUs 1-{gpus - 1} every step, {per_epoch / 1e9:.2f} GB "
            f"per epoch of {steps} steps. With NCCL's ring broadcast, GPU 0 itself sends about one copy "
            f"({model_bytes / 1e6:.1f} MB) to its neighbour, which keeps it and passes it on: every link carries "
            "about one copy per step. In backward, the replicas' gradients are summed onto GPU 0, along a ring "
            "too. In DDP the weights never move: each process sends about 2 x (N - 1) / N copies of the "
            "gradients per step, all processes at once, and mostly while backward is still running (notebook 04).")


HALF = 8  # images per rank: a batch of 16, cut in two as scatter would cut it for 2 GPUs
LR = 0.1  # plain SGD: a step is parameter - LR * gradient
WATCHED = ("reduce", "broadcast", "all_reduce")  # the collectives whose calls and bytes the check records


def through_rank0_in_rank(answer, work):
    """In each of 2 processes: backward on this rank's half, then the participant's step_through_rank0. Every rank
    must end with the weights of one process's SGD step on the whole batch, and rank 0 alone must have stepped.
    The check itself calls no collective, so a wrong answer cannot shift the next answer's collectives."""
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "this check runs in 2 processes"
    model, images, labels = half_batches()
    before = flat(model.parameters())
    a, b = (flat_gradient(model, images[i * HALF:(i + 1) * HALF], labels[i * HALF:(i + 1) * HALF]) for i in range(2))
    whole = step_on_whole_batch(model, images, labels)  # the reference: one process, all 16 images
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    flat_gradient(model, images[rank * HALF:(rank + 1) * HALF], labels[rank * HALF:(rank + 1) * HALF])  # this rank's
    calls = []  # ("step", 0) or (collective, bytes), in the order this rank made them
    hook = optimizer.register_step_post_hook(lambda *_: calls.append(("step", 0)))
    try:
        with in_processes.replaced(answer, watched_collectives(calls)):
            answer.step_through_rank0(model, optimizer)
    finally:
        hook.remove()
    got = flat(model.parameters())
    names = [name for name, _ in calls]
    if not close(got, whole):
        difference = (got - whole).abs().max()
        raise in_processes.Wrong(f"rank {rank}: {wrong_weights_hint(rank, got, before, a, b, names)} (largest "
                                 f"difference from one process's step on the whole batch: {difference:.1e})")
    steps = names.count("step")
    if rank != 0 and steps:
        raise in_processes.Wrong(f"rank {rank} called optimizer.step(): on this route rank 0 alone updates and sends "
                                 "the weights (all_reduce, then a step on every rank, is DDP's way: notebook 04)")
    if rank == 0 and steps != 1:
        raise in_processes.Wrong(f"rank 0 called optimizer.step() {steps} times: once, after the reduce"
                                 if steps else "rank 0 never called optimizer.step(): let its optimizer take the step")
    moved = {name: sum(size for called, size in calls if called == name) for name in WATCHED}
    return {"difference": (got - whole).abs().max().item(), "model_bytes": 4 * before.numel(), **moved}


def wrong_weights_hint(rank, got, before, a, b, names):
    """Name the usual mistake that gives these weights."""
    if close(got, before):
        if rank == 0:
            return "its weights did not change: rank 0 takes the optimizer step, on the mean of the summed gradients"
        if "broadcast" in names:
            return ("this rank called broadcast yet holds the weights from before the step: broadcast rank 0's "
                    "parameters after rank 0's optimizer.step()")
        return "this rank keeps its old weights: after rank 0's step, broadcast rank 0's parameters to every rank"
    if close(got, before - LR * (a + b)):
        return ("this is a step with the sum of the two halves' gradients: on rank 0, divide the summed gradients "
                "by the world size before the step")
    if close(got, before - LR * (a, b)[rank]):
        return ("this is a step with this rank's own half only: sum the gradients on rank 0 with dist.reduce; "
                "on this route rank 0 alone updates and sends the weights")
    return ("these are not the weights of one step on the whole batch: sum the gradients on rank 0 (dist.reduce), "
            "divide there by the world size, step on rank 0 alone, then broadcast rank 0's parameters")


def half_batches():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return models.Net(dropout=False), torch.randn(2 * HALF, 1, 28, 28, generator=generator), \
        torch.randint(10, (2 * HALF,), generator=generator)


def step_on_whole_batch(model, images, labels):
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    flat_gradient(reference, images, labels)
    optimizer.step()
    return flat(reference.parameters())


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def watched_collectives(calls):
    """Replacements of the WATCHED collectives that record each call, with the bytes of the tensor it was given."""
    def watch(name, original):
        def call(tensor, *args, **kwargs):
            calls.append((name, tensor.numel() * tensor.element_size()))
            return original(tensor, *args, **kwargs)
        return call

    return {(dist, name): watch(name, getattr(dist, name)) for name in WATCHED}


@exercise(3, answers=("step_through_rank0",), rank_check=through_rank0_in_rank)
def check_through_rank0(step_through_rank0):
    detail = in_processes.run_check(through_rank0_in_rank, step_through_rank0=step_through_rank0)
    mb = {name: detail[name] / 1e6 for name in ("model_bytes", *WATCHED)}
    if mb["reduce"]:
        gradients = f"each rank handed {mb['reduce']:.1f} MB of gradients to reduce"
    elif mb["all_reduce"]:
        gradients = (f"each rank all-reduced {mb['all_reduce']:.1f} MB of gradients, which gave every rank the sum "
                     "where this route needs it on rank 0 only (dist.reduce)")
    else:
        gradients = "the gradients reached rank 0 by calls this check does not count"
    weights = (f"each rank handed {mb['broadcast']:.1f} MB of weights to broadcast" if mb["broadcast"] else
               "the weights went out by calls this check does not count (it counts dist.broadcast)")
    return (f"in 2 processes with {HALF} of {2 * HALF} images each, every rank holds the weights of one process's "
            f"SGD step on all {2 * HALF} (largest difference {detail['difference']:.1e}), and rank 0 alone "
            f"stepped. Each step, {gradients}; {weights}. The Net is {mb['model_bytes']:.1f} MB. DataParallel "
            "takes this route: gradients summed on GPU 0, one update there while the other GPUs wait, the weights "
            "copied out again. DDP all-reduces the gradients into their mean on every process and each process "
            "steps itself: the weights travel once, when DDP wraps the model (notebook 04).")
