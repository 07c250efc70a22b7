"""The checks of 02_allreduce_by_hand.ipynb's exercises: a rank's shard against DistributedSampler's, the images lost to
a seed per rank, and the participant's averaging of uneven shards' gradients, run in 2 processes. Notebook support:
a learner may skip this module.
"""
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from lesson import models

from . import in_processes
from .gradients import close, flat_gradient
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


UNEVEN_SHARDS = (40, 24)  # images on rank 0 and on rank 1: one batch of 64, split unevenly


def uneven_average_in_rank(answer, work):
    """In each of 2 processes: backward on this rank's shard, then the participant's average_gradients; the result
    must be the whole batch's gradient. The other ways it can come out name the mistake."""
    rank = dist.get_rank()
    assert dist.get_world_size() == len(UNEVEN_SHARDS), "this check runs in 2 processes"
    model, images, labels = uneven_batch()
    bounds = [(0, UNEVEN_SHARDS[0]), (UNEVEN_SHARDS[0], sum(UNEVEN_SHARDS))]
    a, b = (flat_gradient(model, images[start:end], labels[start:end]) for start, end in bounds)
    whole = flat_gradient(model, images, labels)
    start, end = bounds[rank]
    flat_gradient(model, images[start:end], labels[start:end])  # this rank's backward, as in training
    answer.average_gradients(model, UNEVEN_SHARDS[rank])
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    n_a, n_b = UNEVEN_SHARDS
    mistakes = [
        ((a + b) / 2, "this is the plain mean of the ranks' gradients: weight each rank's gradient by its number "
                      "of images, then divide by the images of all ranks"),
        (a + b, "this is the sum of the ranks' gradients: weight each by its images and divide by all ranks' images"),
        (n_a * a + n_b * b, "this is the weighted sum: divide it by the number of images of all ranks together"),
        ((n_a * a + n_b * b) / UNEVEN_SHARDS[rank], "divided by this rank's images only: all_reduce the image "
                                                    "count too, and divide by the total"),
        ((n_a * a + n_b * b) / (UNEVEN_SHARDS[rank] * len(UNEVEN_SHARDS)),
         "divided by this rank's images times the world size, which is the total only when every rank has as many "
         "images: all_reduce the image count, and divide by the total"),
        ((n_a * a + n_b * b) / len(UNEVEN_SHARDS), "this is the weighted sum divided by the world size: divide it by "
                                                   "the number of images of all ranks together (all_reduce the "
                                                   "image count)"),
        ((a, b)[rank], "this rank's gradient is unchanged: all_reduce the gradients, in place"),
        (torch.zeros_like(whole), "the gradients are all zero: a weight computed with // (integer division) is 0 "
                                  "here; divide with /"),
    ]
    if not close(got, whole):
        hint = next((hint for value, hint in mistakes if close(got, value)), "this is not the whole batch's gradient")
        raise in_processes.Wrong(f"rank {rank}: {hint} (largest difference from the whole batch's gradient: "
                                 f"{(got - whole).abs().max():.1e})")
    return {"weighted": (got - whole).abs().max().item(), "plain": ((a + b) / 2 - whole).abs().max().item()}


def uneven_batch():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return models.Net(dropout=False), torch.randn(sum(UNEVEN_SHARDS), 1, 28, 28, generator=generator), \
        torch.randint(10, (sum(UNEVEN_SHARDS),), generator=generator)


@exercise(3, answers=("average_gradients",), rank_check=uneven_average_in_rank)
def check_uneven_average(average_gradients):
    detail = in_processes.run_check(uneven_average_in_rank, average_gradients=average_gradients)
    return (f"in 2 processes with {UNEVEN_SHARDS[0]} and {UNEVEN_SHARDS[1]} images, your average is the whole "
            f"batch's gradient (largest difference {detail['weighted']:.1e}); the plain mean would be off by "
            f"{detail['plain']:.1e}. DistributedSampler gives every rank the same number of images, so the plain "
            "mean (all_reduce, then divide by the world size) is right in training; uneven shards need weights.")
