"""Notebook 01, exercise 1: the sorted indices of the test images a model gets wrong, on every rank (11 test images,
2 ranks: 3 wrong in rank 0's evaluation shard, 1 in rank 1's; each image scored on one rank)."""
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from lesson import data

EXERCISE = "01.1"


def wrong_among(model, test_set, indices):
    """The indices among ``indices`` whose image the model gets wrong."""
    return [index for index in indices if model(test_set[index][0].unsqueeze(0)).argmax().item() != test_set[index][1]]


def gathered(wrong):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wrong)
    return sorted(index for wrong_on_a_rank in everyone for index in wrong_on_a_rank)


def padded(model, test_set):
    return gathered(wrong_among(model, test_set, list(DistributedSampler(test_set, shuffle=False))))


def padded_shuffled(model, test_set):
    return gathered(wrong_among(model, test_set, list(DistributedSampler(test_set))))  # shuffle=True, seed 0


def padded_deduplicated(model, test_set):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wrong_among(model, test_set, list(DistributedSampler(test_set, shuffle=False))))
    return sorted({index for wrong_on_a_rank in everyone for index in wrong_on_a_rank})  # image 0 scored twice


def dropped_last(model, test_set):
    return gathered(wrong_among(model, test_set, list(DistributedSampler(test_set, shuffle=False, drop_last=True))))


def not_gathered(model, test_set):
    return wrong_among(model, test_set, data.evaluation_shard(test_set, dist.get_rank(), dist.get_world_size()).indices)


def shard_positions(model, test_set):
    shard = data.evaluation_shard(test_set, dist.get_rank(), dist.get_world_size())
    return gathered([position for position, (image, label) in enumerate(shard)
                     if model(image.unsqueeze(0)).argmax().item() != label])  # positions in the shard


def all_gather_uneven(model, test_set):
    shard = data.evaluation_shard(test_set, dist.get_rank(), dist.get_world_size())
    mine = torch.tensor(wrong_among(model, test_set, shard.indices))  # 3 indices on rank 0, 1 on rank 1
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return sorted(torch.cat(everyone).tolist())


def whole_set_everywhere(model, test_set):
    return wrong_among(model, test_set, range(len(test_set)))  # right list, but no rank shares the work


def unsorted(model, test_set):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, not_gathered(model, test_set))
    return everyone[0] + everyone[1]


MISTAKES = [
    ({"misclassified": padded}, "DistributedSampler pads"),
    ({"misclassified": padded_shuffled}, "DistributedSampler pads"),
    ({"misclassified": padded_deduplicated}, "image 0 scored on both ranks: DistributedSampler pads"),
    ({"misclassified": dropped_last}, "index 10 is missing: no rank scored it"),
    ({"misclassified": not_gathered}, "all_gather_object"),
    ({"misclassified": shard_positions}, "positions within the ranks' shards"),
    ({"misclassified": all_gather_uneven}, "all_gather_object, or pad to the largest"),
    ({"misclassified": whole_set_everywhere}, "scored all 11 test images"),
    ({"misclassified": unsorted}, "not sorted"),
]
