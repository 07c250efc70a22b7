# Solution to notebook 05, exercise 1: resume an epoch where the checkpoint left it.
# The same sampler, at the same epoch, gives the same order: skip the batches trained before the stop.
import itertools

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def resume_epoch(dataset, batch_size, epoch, batches_done, train_step):
    shards = DistributedSampler(dataset)  # seed 0, shuffled, this rank's share: as the uninterrupted run
    shards.set_epoch(epoch)  # that epoch's order, not epoch 0's
    loader = DataLoader(dataset, batch_size, sampler=shards)
    for images, labels in itertools.islice(loader, batches_done, None):  # the first batches_done batches skipped
        train_step(images, labels)
