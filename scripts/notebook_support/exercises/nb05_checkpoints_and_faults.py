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


def epoch_batches(epoch, rank, skip_images=0):
    """The images of this rank's batches in one epoch of the uninterrupted run (DistributedSampler's defaults,
    set_epoch(epoch)), from the sampler's indices alone; ``skip_images``: that many indices left out first."""
    sampler = DistributedSampler(range(RESUME_IMAGES), num_replicas=dist.get_world_size(), rank=rank)
    sampler.set_epoch(epoch)
    indices = list(sampler)[skip_images:]
    return [indices[start:start + RESUME_BATCH] for start in range(0, len(indices), RESUME_BATCH)]


def resume_epoch_in_rank(answer, work):
    """In each of 2 processes: the participant's resume_epoch at several positions; the batches it hands to
    train_step must be those the uninterrupted run trains after that position. The ways they can come out
    otherwise name the mistake."""
    rank = dist.get_rank()
    trained = 0
    for epoch, done in RESUME_POSITIONS:
        got = []
        answer.resume_epoch(resume_dataset(), RESUME_BATCH, epoch, done,
                            lambda images, labels: got.append((images.tolist(), labels.tolist())))
        expected = epoch_batches(epoch, rank)[done:]
        images = [batch for batch, _ in got]
        where = f"rank {rank}, epoch {epoch} with {done} batches done"
        if images != expected:
            raise AssertionError(f"{where}: {resume_mistake(images, expected, epoch, done, rank)}")
        if any(labels != [image % 10 for image in batch] for batch, labels in got):
            raise AssertionError(f"{where}: train_step got labels that are not its images' labels: pass "
                                 "train_step(images, labels) as the DataLoader gives them")
        trained += len(got)
    return {"positions": len(RESUME_POSITIONS), "batches": trained,
            "per_epoch": len(epoch_batches(0, rank)), "world_size": dist.get_world_size()}


def resume_mistake(images, expected, epoch, done, rank):
    """The hint for batches that differ from the uninterrupted run's: the usual mistake they match, or the first
    batch that differs."""
    share = sum(len(batch) for batch in epoch_batches(epoch, rank))  # this rank's images in an epoch
    seen = {image for batch in images for image in batch}
    if epoch > 0 and images == epoch_batches(0, rank)[done:]:
        return ("these batches come in epoch 0's order: call the sampler's set_epoch(epoch) before the loop, "
                "as the uninterrupted run did each epoch")
    if done > 0 and images == epoch_batches(epoch, rank):
        return (f"the {done} batches trained before the stop are trained again: skip the first batches_done "
                "batches of the epoch")
    if done > 0 and images == epoch_batches(epoch, rank, skip_images=done):
        return (f"you skipped {done} images, not {done} batches: a batch holds batch_size images, so skip "
                "batches_done * batch_size indices, or batches_done batches of the DataLoader")
    if len(seen) > share:
        return (f"this rank trained on {len(seen)} different images, more than its share of {share}: each rank "
                "trains on the whole data set. Draw the indices from DistributedSampler(dataset), not "
                "shuffle=True or a RandomSampler")
    others = [other for other in range(dist.get_world_size()) if other != rank]
    if any(images == epoch_batches(epoch, other)[done:] for other in others):
        return ("these are another rank's batches: let DistributedSampler(dataset) take the rank and the number of "
                "ranks from the process group")
    if len(images) != len(expected):
        return (f"train_step got {len(images)} batches; the uninterrupted run had {len(expected)} left in this "
                "epoch")
    first = next(number for number, (mine, theirs) in enumerate(zip(images, expected)) if mine != theirs)
    return (f"the epoch's batch {done + first} (from 0) holds images {images[first]}; the uninterrupted run's held "
            f"{expected[first]}: the uninterrupted run used DistributedSampler(dataset) with its defaults, "
            "set_epoch(epoch) and DataLoader(dataset, batch_size, sampler=...)")


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
