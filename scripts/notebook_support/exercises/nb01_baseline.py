"""The checks of 01_baseline.ipynb's exercises: the participant's list of the test images a model gets wrong, run in
2 processes, and the images DistributedSampler repeats to pad the test set. Notebook support: a learner may skip
this module.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from . import in_processes
from .registry import exercise


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


# ---------------------------------------------------------------- exercise 1: the misclassified images, in 2 processes

TEST_IMAGES = 11  # odd: a padded DistributedSampler repeats one image (index 0 unshuffled, 10 shuffled with seed 0)
WRONG = [0, 3, 6, 10]  # the images the check's model gets wrong: 3 at even indices, 1 at an odd one
REPEATED = (0, 10)  # the image DistributedSampler(shuffle=False), then with its default shuffle, adds to rank 1
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")  # collectives that need one shape per rank


def misclassified_case():
    """A tiny model and a test set of TEST_IMAGES 1x2x2 images, labelled so that it gets exactly WRONG wrong."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        images = torch.randn(TEST_IMAGES, 1, 2, 2, generator=generator)
        labels = model(images).argmax(dim=1)
    labels[WRONG] = (labels[WRONG] + 1) % 3
    return model, TensorDataset(images, labels)


def misclassified_in_rank(answer, work):
    """In each of 2 processes: the participant's misclassified() on the tiny case; every rank must get WRONG, and
    each test image must be scored on one rank only. The other ways it can come out name the mistake."""
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "this check runs in 2 processes"
    model, test_set = misclassified_case()
    scored = set()  # the test images this rank's model was given, found by matching the input rows to them
    model.register_forward_hook(lambda module, inputs, output: scored.update(images_in(inputs, test_set)))
    with in_processes.replaced(answer, one_shape_per_rank()):
        got = answer.misclassified(model, test_set)
    everyone = [None] * dist.get_world_size()  # the images each rank scored: one collective, after the answer's
    dist.all_gather_object(everyone, sorted(scored))
    try:
        got = [int(index) for index in got]
    except (TypeError, ValueError):
        raise in_processes.Wrong(f"rank {rank}: misclassified returned {type(got).__name__}: return a list of "
                                 "indices, on every rank") from None
    never = sorted(set(range(TEST_IMAGES)) - set(everyone[0]) - set(everyone[1])) if all(everyone) else []
    shard = [index for index in WRONG if index % 2 == rank]  # this rank's wrong images with data.evaluation_shard
    positions = {0: [index // 2 for index in WRONG if index % 2 == 0], 1: [index // 2 for index in WRONG if index % 2]}
    mistakes = [
        *((sorted(WRONG + [index]), f"index {index} is in the list twice: DistributedSampler pads the shards by "
                                    "repeating images; score data.evaluation_shard (every world_size-th image, no "
                                    "padding)") for index in REPEATED),
        (sorted(WRONG * 2), "every wrong image is in the list twice: each rank scored the whole test set; score "
                            "only this rank's share (data.evaluation_shard), then gather"),
        (sorted(set(WRONG) & set(everyone[rank])) if everyone[rank] else shard,
         "these are only this rank's wrong images: gather every rank's (e.g. dist.all_gather_object) and return "
         "them all, on every rank"),
        (sorted(positions[0] + positions[1]), "these are positions within the ranks' shards: return indices in "
                                              "the whole test set (a Subset's .indices maps one to the other)"),
        (positions[rank], "these are positions within this rank's shard, and only its own: return indices in the "
                          "whole test set, gathered from every rank"),
        (sorted(set(WRONG) - set(never)), f"index {', '.join(map(str, never))} is missing: no rank scored it. "
                                          "DistributedSampler(drop_last=True) drops the tail of the data set to "
                                          "even the shards; score data.evaluation_shard (every world_size-th "
                                          "image, no padding, none dropped)"),
    ]
    if got != WRONG:
        hint = next((hint for value, hint in mistakes if got == value),
                    "the right indices, not sorted: sort them" if sorted(got) == WRONG else
                    f"{got} is not the sorted list of the test images the model gets wrong (indices in the whole "
                    "test set, each once)")
        raise in_processes.Wrong(f"rank {rank}: {hint}")
    if len(scored) == TEST_IMAGES:
        raise in_processes.Wrong(f"rank {rank}: right list, but this rank scored all {TEST_IMAGES} test images: "
                                 "score only its share (data.evaluation_shard) and gather the others' results")
    twice = sorted(set(everyone[0]) & set(everyone[1]))
    if twice:
        where = (f"image {twice[0]} scored on both ranks: DistributedSampler pads the shards by repeating images "
                 "(dropping the repeat from the list hides it here, but an accuracy would count it twice)"
                 if len(twice) == 1 and twice[0] in REPEATED else
                 f"images {twice} scored on both ranks: give each image to one rank")
        raise in_processes.Wrong(f"rank {rank}: right list, but {where}; score data.evaluation_shard (every "
                                 "world_size-th image, no padding)")
    return {"wrong": got, "scored": everyone}


def images_in(inputs, test_set):
    """The indices of the test images among the rows of the model's input (none if it is not a tensor of them)."""
    images = test_set.tensors[0].flatten(start_dim=1)
    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].numel() % images.shape[1]:
        return []
    rows = inputs[0].detach().reshape(-1, images.shape[1]).to(images.dtype)
    same = (rows[:, None, :] - images[None]).abs().amax(dim=2) <= 1e-6
    return same.any(dim=0).nonzero().flatten().tolist()


def one_shape_per_rank():
    """Replacements of dist.all_gather and its kin that first compare the tensor's shape on the ranks and raise
    AssertionError on every rank if they differ: gloo would abort the process that receives more bytes than it
    expects ("Received data size doesn't match expected size"), which would end the check's run."""
    return {(dist, name): shape_guard(name, getattr(dist, name)) for name in GATHERS if hasattr(dist, name)}


def shape_guard(name, original):
    def gather(*args, **kwargs):
        tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
        if isinstance(tensor, torch.Tensor):
            shapes = [None] * dist.get_world_size()
            dist.all_gather_object(shapes, tuple(tensor.shape))  # all_gather_object is left as it is
            if len(set(shapes)) > 1:
                sent = ", ".join(f"{tuple(shape)} on rank {rank}" for rank, shape in enumerate(shapes))
                raise in_processes.Wrong(
                    f"rank {dist.get_rank()}: dist.{name} got tensors of different shapes ({sent}), which gloo "
                    "cannot gather (it aborts a process or raises; this check stopped the call): gather lists with "
                    "dist.all_gather_object, or pad to the largest")
        return original(*args, **kwargs)
    return gather


@exercise(1, answers=("misclassified",), rank_check=misclassified_in_rank)
def check_misclassified(misclassified):
    detail = in_processes.run_check(misclassified_in_rank, misclassified=misclassified)
    scored = detail["scored"]
    shares = (", ".join(f"rank {rank} scored {len(images)} images, {len(set(images) & set(WRONG))} of them wrong"
                        for rank, images in enumerate(scored)) + "; " if all(scored) else "")
    return (f"in 2 processes, the model gets {len(detail['wrong'])} of {TEST_IMAGES} test images wrong: {shares}"
            f"every rank returned {detail['wrong']}. Lists of different lengths travel with all_gather_object, "
            "which gathers their sizes first and pads them to the largest; with gloo, dist.all_gather needs one "
            "shape on every rank.")
