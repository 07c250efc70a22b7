"""The check of 05_checkpoints_and_faults.ipynb's exercise: the participant's resumed epoch, run in 2 processes.
Notebook support: a learner may skip this module.
"""
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from . import in_processes
from .registry import exercise

# A data set whose images are their own indices, so that a batch says which samples it holds: 45 samples, batches of
# 4: 23 per rank (one padded), 6 batches per rank and epoch, the last one of 3.
RESUME_IMAGES, RESUME_BATCH = 45, 4
RESUME_POSITIONS = [(0, 0), (0, 2), (1, 3), (2, 0), (4, 5)]  # (epoch, batches_done), as a checkpoint records them


def resume_dataset():
    images = torch.arange(RESUME_IMAGES)
    return TensorDataset(images, images % 10)  # each label follows from its image


def epoch_batches(epoch, rank, skip_images=0, seed=0, shuffle=True, drop_last=False, loader_drop_last=False):
    """The images of this rank's batches in one epoch of the uninterrupted run (DistributedSampler's defaults,
    set_epoch(epoch)), from the sampler's indices alone; ``skip_images``: that many indices left out first. The
    other arguments: those of a run that differs, for the hints."""
    sampler = DistributedSampler(range(RESUME_IMAGES), num_replicas=dist.get_world_size(), rank=rank, seed=seed,
                                 shuffle=shuffle, drop_last=drop_last)
    sampler.set_epoch(epoch)
    indices = list(sampler)[skip_images:]
    batches = [indices[start:start + RESUME_BATCH] for start in range(0, len(indices), RESUME_BATCH)]
    return [batch for batch in batches if len(batch) == RESUME_BATCH] if loader_drop_last else batches


SAMPLER_SEEDS = range(200)  # the seed + epoch values a shuffled order is looked for among, for the hints


def recorder(got):
    """The train_step the check hands the participant: it records each batch, as lists of images and labels."""
    def train_step(images, labels):
        if not (isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)):
            raise in_processes.Wrong(f"train_step got {type(images).__name__} and {type(labels).__name__}: give it "
                                     "the two tensors of a batch, as the DataLoader yields them")
        got.append((images.tolist(), labels.tolist()))
    return train_step


def resume_epoch_in_rank(answer, work):
    """In each of 2 processes: the participant's resume_epoch at several positions; the batches it hands to
    train_step must be those the uninterrupted run trains after that position. The ways they can come out
    otherwise name the mistake. The ranks then share what went wrong, so that a hint can compare them (a seed
    per rank), and give the same verdict."""
    rank = dist.get_rank()
    trained, outcome = 0, {"problem": None, "offset": 0}  # offset: seed + epoch of its shuffled order, minus epoch
    try:
        for epoch, done in RESUME_POSITIONS:
            got = []
            answer.resume_epoch(resume_dataset(), RESUME_BATCH, epoch, done, recorder(got))
            problem, offset = position_problem(got, epoch, done, rank)
            if problem:
                outcome = {"problem": f"rank {rank}, epoch {epoch} with {done} batches done: {problem}",
                           "offset": offset}
                break
            trained += len(got)
    except in_processes.Wrong as wrong:  # from train_step: what the participant's code handed it
        outcome = {"problem": f"rank {rank}: {wrong}", "offset": None}
    except Exception as raised:  # noqa: BLE001 (said in one line, as the worker would, once the ranks have shared)
        outcome = {"problem": in_processes.raised_line(raised, rank), "offset": None}
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)  # the one collective, after the participant's code, on every rank
    problem = resume_problem(outcomes)
    if problem:
        raise in_processes.Wrong(problem)
    return {"positions": len(RESUME_POSITIONS), "batches": trained,
            "per_epoch": len(epoch_batches(0, rank)), "world_size": dist.get_world_size()}


def position_problem(got, epoch, done, rank):
    """(What is wrong with the batches handed to train_step at one position, or None; the offset of the shuffled
    order they follow, when that is what is wrong)."""
    expected = epoch_batches(epoch, rank)[done:]
    images = [batch for batch, _ in got]
    if images == expected:
        if any(labels != [image % 10 for image in batch] for batch, labels in got):
            return ("train_step got labels that are not its images' labels: pass train_step(images, labels) as "
                    "the DataLoader gives them"), None
        return None, 0
    if [labels for _, labels in got] == expected:
        return "train_step got (labels, images): the order is train_step(images, labels)", None
    return resume_mistake(images, expected, epoch, done, rank)


def resume_mistake(images, expected, epoch, done, rank):
    """The hint for batches that differ from the uninterrupted run's: the usual mistake they match, or the first
    batch that differs; and the offset of the shuffled order they follow, if that is the mistake."""
    whole = epoch_batches(epoch, rank)
    share = sum(len(batch) for batch in whole)  # this rank's images in an epoch
    seen = {image for batch in images for image in batch}
    if epoch > 0 and images == epoch_batches(0, rank)[done:]:
        return ("these batches come in epoch 0's order: call the sampler's set_epoch(epoch) before the loop, "
                "as the uninterrupted run did each epoch"), None
    if done > 0 and images == whole:
        return (f"the {done} batches trained before the stop are trained again: skip the first batches_done "
                "batches of the epoch"), None
    skipped = next((number for number in range(len(whole) + 1) if images == whole[number:]), None)
    if skipped is not None:
        return (f"you skipped {skipped} batch{'es' * (skipped != 1)}; the checkpoint records {done} as trained: "
                "skip exactly batches_done batches"), None
    if done > 0 and images == whole[:-done]:
        return (f"you left out the epoch's last {done} batches: the first batches_done batches are the ones "
                "trained before the stop"), None
    if done > 0 and images == epoch_batches(epoch, rank, skip_images=done):
        return (f"you skipped {done} images, not {done} batches: a batch holds batch_size images, so skip "
                "batches_done * batch_size indices, or batches_done batches of the DataLoader"), None
    if len(seen) > share:
        whose = "the whole data set" if len(seen) == RESUME_IMAGES else "other ranks' images too"
        return (f"this rank trained on {len(seen)} different images, more than its share of {share}, so this rank "
                f"trains on {whose}. Draw the indices from DistributedSampler(dataset), not shuffle=True or a "
                "RandomSampler"), None
    others = [other for other in range(dist.get_world_size()) if other != rank]
    if any(images == epoch_batches(epoch, other)[done:] for other in others):
        return ("these are another rank's batches: let DistributedSampler(dataset) take the rank and the number of "
                "ranks from the process group"), None
    if images == epoch_batches(epoch, rank, shuffle=False)[done:]:
        return ("these batches come in the data set's order: the uninterrupted run's DistributedSampler shuffled "
                "(shuffle=True, its default), in a new order each epoch"), None
    if images == epoch_batches(epoch, rank, loader_drop_last=True)[done:]:
        return (f"the epoch's last batch, of {len(whole[-1])} images, is missing: the uninterrupted run's "
                "DataLoader kept it (drop_last=False, its default)"), None
    if images == epoch_batches(epoch, rank, drop_last=True)[done:]:
        return ("the sampler left out the images that do not divide evenly among the ranks (drop_last=True): the "
                "uninterrupted run's DistributedSampler repeated some instead (drop_last=False, its default)"), None
    order = next((k for k in SAMPLER_SEEDS if images == epoch_batches(k, rank)[done:]), None)
    if order is not None:
        return (f"these batches come in the order of seed + epoch = {order}, not {epoch}: DistributedSampler "
                "shuffles with seed + epoch, and the uninterrupted run kept the default seed, 0, and called "
                "set_epoch(epoch) with the epoch as given"), order - epoch
    if len(images) != len(expected):
        return (f"train_step got {len(images)} batches; the uninterrupted run had {len(expected)} left in this "
                "epoch"), None
    first = next(number for number, (mine, theirs) in enumerate(zip(images, expected)) if mine != theirs)
    return (f"the epoch's batch {done + first} (from 0) holds images {images[first]}; the uninterrupted run's held "
            f"{expected[first]}: the uninterrupted run used DistributedSampler(dataset) with its defaults, "
            "set_epoch(epoch) and DataLoader(dataset, batch_size, sampler=...)"), None


def resume_problem(outcomes):
    """The verdict, from every rank's outcome (the same on every rank): the first rank's problem, unless the ranks'
    shuffled orders differ by a seed of their own."""
    first = next((outcome["problem"] for outcome in outcomes if outcome["problem"]), None)
    offsets = [outcome["offset"] for outcome in outcomes]
    if first and None not in offsets and len(set(offsets)) > 1:
        seeds = ", ".join(f"rank {rank} as with seed={offset}" for rank, offset in enumerate(offsets))
        return (f"the ranks shuffle with different seeds ({seeds}): DistributedSampler needs the same seed on "
                "every rank (its default, 0), or the ranks' shares overlap and miss images")
    return first


@exercise(1, answers=("resume_epoch",), rank_check=resume_epoch_in_rank)
def check_resume_epoch(resume_epoch):
    detail = in_processes.run_check(resume_epoch_in_rank, resume_epoch=resume_epoch)
    return (f"in {detail['world_size']} processes, at {detail['positions']} positions (epochs 0 to "
            f"{RESUME_POSITIONS[-1][0]}, 0 to {max(done for _, done in RESUME_POSITIONS)} of "
            f"{detail['per_epoch']} batches done), each rank trained exactly the batches the uninterrupted run had "
            "left, in its order. That order follows from the seed and the epoch alone, so a checkpoint stores the "
            "position, not the sampler. Skipping batches of a DataLoader still loads them; the course's DataLoader "
            "route (SkippingSampler in kit/datasets.py) leaves out batches_done * batch_size of the sampler's "
            "indices instead, and loads nothing it skips.")
