"""The checks of 06_real_models.ipynb's exercises: the participant's freezing and wrapping of a ResNet-18 for a
fine-tune, trained in 2 processes with the bytes DDP all-reduces counted, and the GPUs each replica of the
model-parallel script takes. Notebook support: a learner may skip this module.
"""
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from . import in_processes
from .registry import exercise


def ddp_bytes_per_step(model):
    """What DDP hands to its collectives in one training step of ``model`` (CIFAR-shaped inputs), in a world of
    one process made for the count if there is none, in bytes: the gradients it all-reduces, counted by a
    communication hook, and the buffers it broadcasts from rank 0 once a training step (before a forward that
    follows a training forward, or the first), counted where DDP makes that call (``_pre_forward`` ->
    ``_sync_buffers`` -> ``_distributed_broadcast_coalesced`` in torch/nn/parallel/distributed.py), which the
    gradient hook of ``register_comm_hook`` does not see. Which tensors these are depends on the model and its
    requires_grad flags, not on how many processes there are."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    own_group = not dist.is_initialized()
    if own_group:  # a world of one needs no port: an in-process store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sent = {"gradients all-reduced": 0, "buffers broadcast": 0}

        def count_then_allreduce(state, bucket):
            sent["gradients all-reduced"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        wrapped = DDP(model)  # its constructor broadcasts every parameter and buffer once: not a step's traffic
        wrapped.register_comm_hook(None, count_then_allreduce)
        broadcast = wrapped._distributed_broadcast_coalesced

        def count_then_broadcast(tensors, *args):
            sent["buffers broadcast"] += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            return broadcast(tensors, *args)

        wrapped._distributed_broadcast_coalesced = count_then_broadcast
        wrapped(torch.randn(2, 3, 32, 32)).sum().backward()
        return sent
    finally:
        if own_group:
            dist.destroy_process_group()


FINETUNE_TRAINS = ("layer4.", "fc.")  # the recipe: ResNet-18's last block and its head train, the rest is frozen
FINETUNE_STEPS = 2
FINETUNE_BATCH = (2, 3, 32, 32)  # images per rank: a different 2 on each
REDUCTION_UNFINISHED = "Expected to have finished reduction in the prior iteration"  # reducer.cpp's error


def finetune_wrap_in_rank(answer, work):
    """In each of 2 processes: the participant's wrap_for_finetune on a seeded 10-class ResNet-18, then 2 SGD steps
    on the parameters that require grad, with a communication hook counting the gradient bytes DDP all-reduces.
    Right: those bytes are layer4's and fc's gradients, the frozen parameters are unchanged, and layer4 and fc moved
    and are equal on both ranks. The other ways it can come out name the mistake."""
    rank = dist.get_rank()
    model = copy.deepcopy(_seeded_resnet())
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    sizes = {name: parameter.numel() * parameter.element_size() for name, parameter in model.named_parameters()}
    expected = sum(size for name, size in sizes.items() if name.startswith(FINETUNE_TRAINS))
    head = sum(size for name, size in sizes.items() if name.startswith("fc."))
    wrapped = answer.wrap_for_finetune(model)
    if not isinstance(wrapped, torch.nn.Module):
        raise in_processes.Wrong(f"rank {rank}: wrap_for_finetune returned a {type(wrapped).__name__}: return the "
                                 "model wrapped in DistributedDataParallel")
    sent = []  # the gradient bytes DDP all-reduced, per step

    def count_then_average(state, bucket):
        sent[-1] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(None, bucket)  # DDP's own: divide by the world size, all_reduce

    if isinstance(wrapped, DDP):
        wrapped.register_comm_hook(None, count_then_average)
    module = wrapped.module if isinstance(wrapped, DDP) else wrapped
    trained = [parameter for parameter in wrapped.parameters() if parameter.requires_grad]
    if not trained:
        raise in_processes.Wrong(f"rank {rank}: no parameter requires grad: layer4 and fc must train")
    optimizer = torch.optim.SGD(trained, lr=0.1)
    generator = torch.Generator().manual_seed(1 + rank)
    failure = None
    for step in range(1, FINETUNE_STEPS + 1):
        sent.append(0)
        images = torch.randn(FINETUNE_BATCH, generator=generator)
        labels = torch.randint(10, FINETUNE_BATCH[:1], generator=generator)
        try:
            optimizer.zero_grad()
            F.cross_entropy(wrapped(images), labels).backward()
            optimizer.step()
        except RuntimeError as error:  # both ranks stop at the same point: no collective is left unmatched
            failure = step, (str(error).strip().splitlines() or [""])[0]
            break
    if failure:
        step, message = failure
        if REDUCTION_UNFINISHED in message:
            raise in_processes.Wrong(f'rank {rank}: training step {step} raised "{REDUCTION_UNFINISHED} before '
                                     'starting a new one": freeze before you wrap: DDP fixes the parameters it '
                                     'averages when it is built, then waits each step for a gradient of every one '
                                     'of them')
        raise in_processes.Wrong(f"rank {rank}: training step {step} of the returned model raised RuntimeError: "
                                 f"{message[:200]}")
    weights = {name: parameter.detach() for name, parameter in module.named_parameters()}
    trains = torch.cat([weights[name].flatten() for name in sizes if name.startswith(FINETUNE_TRAINS)]).double()
    fingerprint = torch.stack([trains.sum(), trains.square().sum(), trains.abs().max()])  # equal weights: equal prints
    ranks = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, fingerprint)
    if not all(torch.equal(other, ranks[0]) for other in ranks):
        hint = ("return the model wrapped in DistributedDataParallel, which averages the gradients"
                if not isinstance(wrapped, DDP) else "DDP should have kept them equal")
        raise in_processes.Wrong(f"rank {rank}: the ranks' weights differ after a step: {hint}")
    for got in sent:
        if got != expected:
            whole = sum(sizes.values())
            hint = {whole: "the whole model's gradients: set requires_grad = False on every parameter outside "
                           "layer4 and fc, before you wrap",
                    head: "the head's alone: layer4 must train too"}.get(got) or wrong_flag(module)
            raise in_processes.Wrong(f"rank {rank}: DDP all-reduced {got:,} bytes of gradients a step against "
                                     f"{expected:,} for layer4 and fc: {hint}")
    changed = [name for name in sizes if not name.startswith(FINETUNE_TRAINS)
               and not torch.equal(weights[name], before[name])]
    if changed:
        raise in_processes.Wrong(f"rank {rank}: {changed[0]} changed in training: every parameter outside layer4 "
                                 "and fc must stay frozen")
    for prefix in FINETUNE_TRAINS:
        if all(torch.equal(weights[name], before[name]) for name in sizes if name.startswith(prefix)):
            raise in_processes.Wrong(f"rank {rank}: {prefix.rstrip('.')} did not change in {FINETUNE_STEPS} steps: "
                                     "it must train")
    return {"bytes": expected, "whole": sum(sizes.values()), "head": head,
            "trained": sum(weights[name].numel() for name in sizes if name.startswith(FINETUNE_TRAINS)),
            "parameters": sum(weight.numel() for weight in weights.values())}


def wrong_flag(module):
    """The first parameter, in the model's order, whose requires_grad is not the recipe's, named."""
    for name, parameter in module.named_parameters():
        if parameter.requires_grad and not name.startswith(FINETUNE_TRAINS):
            return f"{name} requires grad, but only layer4 and fc should train"
        if not parameter.requires_grad and name.startswith(FINETUNE_TRAINS):
            return f"{name} is frozen, but every parameter of layer4 and fc should train"
    return "exactly layer4's and fc's parameters must require grad, when you wrap"


@functools.cache
def _seeded_resnet():
    """The 10-class ResNet-18 every answer starts from (a copy of it), built once per process."""
    from kit.more_models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=10)


@exercise(1, answers=("wrap_for_finetune",), rank_check=finetune_wrap_in_rank)
def check_finetune_wrap(wrap_for_finetune):
    detail = in_processes.run_check(finetune_wrap_in_rank, wrap_for_finetune=wrap_for_finetune)
    return (f"in 2 processes, {FINETUNE_STEPS} steps each, DDP all-reduced {detail['bytes']:,} bytes of gradients "
            f"a step, layer4's and fc's ({detail['trained']:,} of {detail['parameters']:,} parameters), against "
            f"{detail['whole']:,} with nothing frozen; the frozen layers kept their weights, and layer4 and fc stayed "
            "equal on both ranks. DDP picks the parameters it averages (those that require grad) when it is built: "
            "freeze first, then wrap.")

# (nodes, GPUs per node, processes per node): jobs of the model-parallel script
REPLICA_CASES = [(1, 4, 2), (2, 8, 4), (2, 4, 2), (3, 8, 3)]


def _replica_gpus(rank, gpus_per_node, processes_per_node, nodes):
    """What step6_model_parallel.py does for global rank ``rank``: (node, first GPU, second GPU)."""
    import datetime
    from unittest import mock

    from lesson.model_parallel import replica_devices
    from lesson.process import Runtime

    node, local_rank = divmod(rank, processes_per_node)  # the node of group rank 0 holds the first ranks
    runtime = Runtime(rank=rank, local_rank=local_rank, world_size=nodes * processes_per_node,
                      local_world_size=processes_per_node, device=torch.device("cuda", local_rank), backend="nccl",
                      threads=1, timeout=datetime.timedelta(minutes=5))
    with mock.patch.object(torch.cuda, "device_count", return_value=gpus_per_node):
        first, second = replica_devices(runtime)
    return node, first.index, second.index


@exercise(2, answers=("replica_gpus",))
def check_replica_gpus(replica_gpus):
    for nodes, gpus, processes in REPLICA_CASES:
        for rank in range(nodes * processes):
            expected = _replica_gpus(rank, gpus, processes, nodes)
            got = tuple(replica_gpus(rank, gpus, processes))
            assert got == expected, (
                f"replica_gpus({rank}, {gpus}, {processes}) = {got}: on {nodes} node(s) of {gpus} GPUs with "
                f"{processes} processes each, rank {rank} runs on node {expected[0]}; which rank picks the GPUs?")
    node, first, second = _replica_gpus(5, 8, 4, nodes=2)
    return (f"On 2 nodes of 8 GPUs, rank 5 is LOCAL_RANK 1 of node {node} and takes its GPUs {first} and {second}: "
            "the GPU numbers start again on every node, so they come from the local rank. With 3 processes on an "
            "8-GPU node, GPUs 6 and 7 stay idle: launch --nproc-per-node=GPUs/2 (scripts/tools/launch.py "
            "--gpus-per-process 2 does).")
