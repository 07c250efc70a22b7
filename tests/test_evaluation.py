"""Distributed evaluation counts every test sample once, whatever the world size."""
import datetime

import pytest
import torch
from torch.utils.data import Subset

from distributed_helpers import run_in_group
from kit import datasets
from lesson import data, loop, models, process
from machinery.cli import DEFAULT_DATA_DIR

ODD_SIZE = 999  # divides neither by 2 nor by the evaluation batch


def odd_test_set():
    _, test = data.load_datasets("mnist5k", DEFAULT_DATA_DIR)
    return Subset(test, range(ODD_SIZE))


def trained_a_little():
    """A model with a loss well below chance, so a double count would show in the metrics."""
    torch.manual_seed(0)
    model = models.Net(dropout=False)
    train, _ = data.load_datasets("mnist5k", DEFAULT_DATA_DIR)
    images, labels = datasets.as_tensors(Subset(train, range(256)))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for start in range(0, 256, 64):
        loop.train_step(model, optimizer, images[start:start + 64], labels[start:start + 64])
    return model


def cpu_runtime(rank, world_size, backend):
    return process.Runtime(rank, rank, world_size, world_size, torch.device("cpu"), backend, 1,
                               datetime.timedelta(seconds=60))


def evaluate_on_rank(rank, world_size, state):
    model = models.Net(dropout=False)
    model.load_state_dict(state)
    runtime = cpu_runtime(rank, world_size, "gloo")
    return loop.evaluate(model, loop.TestSet(odd_test_set(), runtime), runtime, batch_size=100)


@pytest.fixture(scope="module")
def model():
    return trained_a_little()


def test_two_ranks_equal_one_process_on_an_odd_sized_test_set(model):
    single_runtime = cpu_runtime(0, 1, None)
    single = loop.evaluate(model, loop.TestSet(odd_test_set(), single_runtime), single_runtime, batch_size=100)
    ranks = run_in_group(evaluate_on_rank, model.state_dict())
    assert 0.2 < single["test_accuracy"] < 1.0  # a model that is neither random nor perfect
    for result in ranks:
        assert result["test_samples"] == single["test_samples"] == ODD_SIZE
        assert result["test_accuracy"] == single["test_accuracy"]  # exact: the same correct count
        assert result["test_loss"] == pytest.approx(single["test_loss"], abs=1e-6)


def test_the_shards_hold_every_sample_once():
    shards = [data.evaluation_shard(odd_test_set(), rank, 2).indices for rank in range(2)]
    assert sorted([*shards[0], *shards[1]]) == list(range(ODD_SIZE))
