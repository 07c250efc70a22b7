"""DistributedSampler: disjoint shards that cover the data, reshuffled by set_epoch."""
import pytest
from torch.utils.data.distributed import DistributedSampler


def shards(size, world_size, epoch=None, seed=0):
    samplers = [DistributedSampler(range(size), num_replicas=world_size, rank=r, seed=seed) for r in range(world_size)]
    if epoch is not None:
        for sampler in samplers:
            sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shards_are_disjoint_and_cover_the_data(world_size):
    size = 4200  # divisible by 2, 3 and 4: no padding
    parts = shards(size, world_size, epoch=1)
    every = [i for part in parts for i in part]
    assert sorted(every) == list(range(size))  # each index exactly once: disjoint, and nothing missing


def test_uneven_size_is_padded_with_repeats():
    """1,001 samples on 2 ranks: 501 each, so one sample is seen twice. Why evaluation must not use it."""
    parts = shards(1001, 2, epoch=0)
    assert [len(p) for p in parts] == [501, 501]
    every = parts[0] + parts[1]
    assert set(every) == set(range(1001)) and len(every) - len(set(every)) == 1


def test_set_epoch_changes_the_order_and_the_shards():
    first, second = shards(100, 2, epoch=1), shards(100, 2, epoch=2)
    assert first[0] != second[0]
    assert set(first[0]) != set(second[0])  # a rank sees different samples, not only a new order


def test_without_set_epoch_every_epoch_repeats_the_same_order():
    sampler = DistributedSampler(range(100), num_replicas=2, rank=0, seed=0)
    assert list(sampler) == list(sampler)


def test_one_replica_splits_into_the_ranks_shards():
    """The course's baseline sampler (one replica) and the 2-rank shards share one shuffle,
    which is what makes the single process and the 2-process runs comparable step for step."""
    whole = shards(4000, 1, epoch=3)[0]
    parts = shards(4000, 2, epoch=3)
    assert parts[0] == whole[0::2] and parts[1] == whole[1::2]
