"""The checks of 06_real_models.ipynb's exercises: the bytes DDP sends per step when fine-tuning, counted where DDP
sends them, and the GPUs each replica of the model-parallel script takes. Notebook support: a learner may skip this
module.
"""
import torch

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


def _cifar_resnet_training(*prefixes):
    """ResNet-18 for CIFAR-10's 10 classes; only the parameters under ``prefixes`` train."""
    from kit.more_models import resnet18

    model = resnet18(num_classes=10)
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(prefixes)
    return model


@exercise(1, answers=("head_bytes", "layer4_and_head_bytes", "buffer_bytes"))
def check_finetune_bytes(head_bytes, layer4_and_head_bytes, buffer_bytes):
    head = ddp_bytes_per_step(_cifar_resnet_training("fc."))
    assert head_bytes == head["gradients all-reduced"], (
        f"head_bytes = {head_bytes:,}: the head of a 10-class ResNet-18 has a weight and a bias; how many values, "
        "and how many bytes each?")
    both = ddp_bytes_per_step(_cifar_resnet_training("fc.", "layer4."))
    assert layer4_and_head_bytes == both["gradients all-reduced"], (
        f"layer4_and_head_bytes = {layer4_and_head_bytes:,} is not what DDP all-reduced: DDP reduces the gradients "
        "of the parameters that train; does everything in layer4's state_dict have a gradient?")
    assert buffer_bytes == head["buffers broadcast"], (
        f"buffer_bytes = {buffer_bytes:,} is not what DDP broadcast: it copies every buffer of the model from rank 0 "
        "before each training forward, whatever trains; which buffers does a BatchNorm layer hold, and of which dtype?")
    everything = ddp_bytes_per_step(_cifar_resnet_training(""))
    total = {name: sum(sent.values()) for name, sent in (("head", head), ("all", everything))}
    gradients_ratio = everything["gradients all-reduced"] / head["gradients all-reduced"]
    return (f"Per training step DDP all-reduced {head['gradients all-reduced']:,} bytes of gradients with the head "
            f"alone, {both['gradients all-reduced']:,} with layer4 too, {everything['gradients all-reduced']:,} with "
            f"every layer, and broadcast the same {buffer_bytes:,} bytes of BatchNorm buffers each time. With the "
            f"head alone that is {total['head']:,} bytes a step: {total['all'] / total['head']:,.0f} times fewer "
            f"than training every layer, not the {gradients_ratio:,.0f} times the gradients alone suggest.")


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
