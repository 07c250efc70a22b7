# Solution to notebook 02, exercise 1: a DistributedSampler by hand.
import torch


def shard(n, world_size, rank, seed, epoch):
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)  # the same on every rank: no communication needed
    order = torch.randperm(n, generator=generator).tolist()
    order += order[: -n % world_size]  # pad to a multiple of world_size with the first indices
    return order[rank::world_size]  # every world_size-th index, starting at this rank
