"""The checks of 02_allreduce_by_hand.ipynb's exercises: a rank's shard against DistributedSampler's, the images lost to
a seed per rank, and the mean of uneven shards' gradients. Notebook support: a learner may skip this module.
"""
import torch
from torch.utils.data.distributed import DistributedSampler

from .registry import exercise

SHARD_CASES = [(4000, 2, 0, 1), (4000, 2, 0, 2), (1000, 3, 7, 5), (10, 4, 0, 0)]  # n, world size, seed, epoch


@exercise(1, answers=("shard",))
def check_shard(shard):
    for n, world_size, seed, epoch in SHARD_CASES:
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)
            sampler.set_epoch(epoch)
            got = list(shard(n, world_size, rank, seed, epoch))
            assert got == list(sampler), (
                f"shard({n}, {world_size}, {rank}, {seed}, {epoch}) differs from DistributedSampler's indices"
                + (f" in length ({len(got)} against {len(sampler)})" if len(got) != len(sampler) else ""))
    return "shard() gives DistributedSampler's indices, padding included: no communication needed."


@exercise(2, answers=("overlap", "never_seen"))
def check_seed_per_rank(overlap, never_seen, images=4000):
    rank0 = set(DistributedSampler(range(images), num_replicas=2, rank=0, seed=0))
    rank1 = set(DistributedSampler(range(images), num_replicas=2, rank=1, seed=1))
    assert overlap == len(rank0 & rank1), f"overlap = {overlap} is not the number of images on both ranks"
    assert never_seen == images - len(rank0 | rank1), f"never_seen = {never_seen} is not the number on neither rank"
    return (f"{overlap:,} of the {images:,} images are on both ranks and {never_seen:,} on neither: every "
            "duplicate leaves one image out. Nothing fails and the loss still goes down, which is what makes "
            "this bug expensive: each epoch trains on about three quarters of the data. Give every rank the same "
            "sampler seed; different seeds only for what should differ, such as dropout masks.")


@exercise(3, answers=("plain", "weighted"))
def check_weighted_mean(plain, weighted, gradient, images, labels, split=40):
    whole = gradient(images, labels)
    first, second = gradient(images[:split], labels[:split]), gradient(images[split:], labels[split:])
    n = len(labels)
    assert torch.allclose(plain, (first + second) / 2, atol=1e-7), "plain should be the mean of the two shard gradients"
    assert torch.allclose(weighted, (split * first + (n - split) * second) / n, atol=1e-7), (
        "weighted should weight each shard's gradient by its number of images")
    error_plain, error_weighted = (plain - whole).abs().max().item(), (weighted - whole).abs().max().item()
    assert error_weighted < 1e-6 < 1e-3 < error_plain, (error_plain, error_weighted)
    return ("Weighted by shard size, the mean is the whole batch's gradient (within 1e-6); the plain mean is off "
            "by more than 1e-3. all_reduce followed by a division by the world size is the plain mean, so every "
            "rank must bring a batch of the same size.")
