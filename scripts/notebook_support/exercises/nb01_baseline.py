"""The checks of 01_baseline.ipynb's exercises: the Net's FLOPs, against PyTorch's FLOP counter, and the images
DistributedSampler repeats to pad the test set. Notebook support: a learner may skip this module.
"""
import torch
from torch.utils.data.distributed import DistributedSampler

from .registry import exercise


def forward_flops_per_layer():
    """PyTorch's own count of the Net's forward FLOPs for one image, per module."""
    from torch.utils.flop_counter import FlopCounterMode

    from lesson.models import Net

    counter = FlopCounterMode(display=False)
    with counter:
        Net()(torch.zeros(1, 1, 28, 28))
    return {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}


@exercise(1, answers=("conv2_flops", "fc1_flops"))
def check_flops(conv2_flops, fc1_flops):
    counted = forward_flops_per_layer()
    assert conv2_flops == counted["Net.conv2"], f"conv2_flops = {conv2_flops:,} is not what PyTorch counts for conv2"
    assert fc1_flops == counted["Net.fc1"], f"fc1_flops = {fc1_flops:,} is not what PyTorch counts for fc1"
    return (f"conv2: {conv2_flops:,} FLOP, fc1: {fc1_flops:,} FLOP per image, forward, as PyTorch counts them. "
            "fc1 holds almost all the parameters but conv2 does most of the work: a convolution uses each "
            "of its weights at every one of its 24 x 24 output positions, a linear layer uses each weight once.")


@exercise(2, answers=("repeated",))
def check_padding(repeated, test_images=10_000, world_sizes=range(1, 9)):
    assert sorted(repeated) == list(world_sizes), f"repeated needs one entry for each world size {list(world_sizes)}"
    for world_size in world_sizes:
        per_rank = len(DistributedSampler(range(test_images), num_replicas=world_size, rank=0, shuffle=False))
        assert repeated[world_size] == per_rank * world_size - test_images, (
            f"world size {world_size}: DistributedSampler repeats a different number of images than "
            f"{repeated[world_size]}")
    padded = {w: n for w, n in repeated.items() if n}
    return f"World sizes that pad {test_images:,} test images, and by how many: {padded}."
