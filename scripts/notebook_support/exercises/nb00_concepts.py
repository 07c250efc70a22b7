"""The checks of 00_concepts.ipynb's exercises: where a global rank runs (its node, local rank and device), and what
each collective leaves on every rank, against a torchrun of the collectives demo. Notebook support: a learner may
skip this module.
"""
import functools
import json
import tempfile
from pathlib import Path

from .registry import exercise


@exercise(1, answers=("where", "crash_with_global_rank"))
def check_where(where, crash_with_global_rank, nodes=3, gpus_per_node=4):
    world = nodes * gpus_per_node
    for rank in range(world):
        node, local_rank = divmod(rank, gpus_per_node)  # torchrun fills group rank 0's node, then 1's, ...
        got = where(rank, gpus_per_node)
        assert tuple(got) == (node, local_rank, f"cuda:{local_rank}"), (
            f"where({rank}, {gpus_per_node}) returned {got!r}: check the node, the local rank and the device")
    expected = [rank for rank in range(world) if rank >= gpus_per_node]  # no node has cuda:4 or more
    assert sorted(crash_with_global_rank) == expected, (
        f"crash_with_global_rank should hold every rank whose cuda:{{rank}} does not exist on a "
        f"{gpus_per_node}-GPU node")
    return (f"Rank 6 runs on node {where(6, gpus_per_node)[0]} as {where(6, gpus_per_node)[2]}; "
            f"with cuda:{{rank}}, ranks {expected[0]}-{expected[-1]} would fail with 'invalid device ordinal'.")


@functools.cache
def collectives_record(world_size):
    """What every rank of the collectives demo held, from a real torchrun with world_size processes."""
    from ..runs import torchrun

    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "collectives.json"
        torchrun("demos/collectives.py", "--device", "cpu", "--backend", "gloo", "--json", record,
                 nproc=world_size, echo=False)
        return json.loads(record.read_text())


@exercise(2, answers=("predict",))
def check_predict(predict, world_size=3):
    prediction = predict(world_size)
    assert set(prediction) == {"all_reduce", "all_reduce_mean", "all_gather"}, (
        f"predict({world_size}) should return a dict with the keys all_reduce, all_reduce_mean and all_gather")
    observed = collectives_record(world_size)  # the demo, run now with world_size processes
    for collective, after in prediction.items():
        assert observed[collective]["after"] == after, (
            f"{collective}: you predicted {after}, the {world_size} ranks held {observed[collective]['after']}")
    return (f"The demo ran with {world_size} processes and every rank held what you predicted "
            f"(after all_reduce: {observed['all_reduce']['after'][0]}).")
