"""Notebook 05, exercise 1: resume an epoch after batches_done of its batches (45 samples, batches of 4, 2 ranks)."""
import itertools

from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

EXERCISE = "05.1"


def no_set_epoch(dataset, batch_size, epoch, batches_done, train_step):
    loader = DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset))  # every epoch in epoch 0's order
    for images, labels in itertools.islice(loader, batches_done, None):
        train_step(images, labels)


def no_skipping(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    for images, labels in DataLoader(dataset, batch_size, sampler=sampler):  # the whole epoch, again
        train_step(images, labels)


def skipped_images(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    indices = list(sampler)[batches_done:]  # batches_done indices, not batches_done batches
    for images, labels in DataLoader(dataset, batch_size, sampler=indices):
        train_step(images, labels)


def shuffled_loader(dataset, batch_size, epoch, batches_done, train_step):
    loader = DataLoader(dataset, batch_size, shuffle=True)  # the whole data set on every rank
    for images, labels in itertools.islice(loader, batches_done, None):
        train_step(images, labels)


def random_sampler(dataset, batch_size, epoch, batches_done, train_step):
    loader = DataLoader(dataset, batch_size, sampler=RandomSampler(dataset))
    for number, (images, labels) in enumerate(loader):
        if number >= batches_done:
            train_step(images, labels)


def rank_zero_everywhere(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0)  # rank 0's share on every rank
    sampler.set_epoch(epoch)
    for images, labels in itertools.islice(DataLoader(dataset, batch_size, sampler=sampler), batches_done, None):
        train_step(images, labels)


MISTAKES = [
    ({"resume_epoch": no_set_epoch}, "epoch 0's order"),
    ({"resume_epoch": no_skipping}, "trained again"),
    ({"resume_epoch": skipped_images}, "images, not"),
    ({"resume_epoch": shuffled_loader}, "whole data set"),
    ({"resume_epoch": random_sampler}, "whole data set"),
    ({"resume_epoch": rank_zero_everywhere}, "another rank's batches"),
]
