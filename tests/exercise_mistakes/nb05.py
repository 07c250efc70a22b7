"""Notebook 05, exercise 1: resume an epoch after batches_done of its batches (45 samples, batches of 4, 2 ranks)."""
import itertools

import torch.distributed as dist
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


def next_epoch(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch + 1)  # as if the epochs counted from 1
    for images, labels in itertools.islice(DataLoader(dataset, batch_size, sampler=sampler), batches_done, None):
        train_step(images, labels)


def seed_per_rank(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset, seed=dist.get_rank())  # the ranks' shares overlap
    sampler.set_epoch(epoch)
    for images, labels in itertools.islice(DataLoader(dataset, batch_size, sampler=sampler), batches_done, None):
        train_step(images, labels)


def not_shuffled(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset, shuffle=False)
    sampler.set_epoch(epoch)
    for images, labels in itertools.islice(DataLoader(dataset, batch_size, sampler=sampler), batches_done, None):
        train_step(images, labels)


def one_batch_too_many(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    for number, (images, labels) in enumerate(DataLoader(dataset, batch_size, sampler=sampler)):
        if number > batches_done:  # batch number batches_done is not done yet
            train_step(images, labels)


def last_batch_dropped(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size, sampler=sampler, drop_last=True)
    for images, labels in itertools.islice(loader, batches_done, None):
        train_step(images, labels)


def swapped(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    for images, labels in itertools.islice(DataLoader(dataset, batch_size, sampler=sampler), batches_done, None):
        train_step(labels, images)


def samples_not_tensors(dataset, batch_size, epoch, batches_done, train_step):
    sampler = DistributedSampler(dataset)
    sampler.set_epoch(epoch)
    indices = list(sampler)[batches_done * batch_size:]
    for start in range(0, len(indices), batch_size):
        batch = [dataset[i] for i in indices[start:start + batch_size]]
        train_step([image for image, _ in batch], [label for _, label in batch])  # lists, not a batch's tensors


MISTAKES = [
    ({"resume_epoch": samples_not_tensors}, "give it the two tensors of a batch"),
    ({"resume_epoch": no_set_epoch}, "epoch 0's order"),
    ({"resume_epoch": no_skipping}, "trained again"),
    ({"resume_epoch": skipped_images}, "images, not"),
    ({"resume_epoch": shuffled_loader}, "whole data set"),
    ({"resume_epoch": random_sampler}, "whole data set"),
    ({"resume_epoch": rank_zero_everywhere}, "another rank's batches"),
    ({"resume_epoch": next_epoch}, "rank 0, epoch 0 with 0 batches done: these batches come in the order of seed + "
                                   "epoch = 1, not 0"),
    ({"resume_epoch": seed_per_rank}, "the ranks shuffle with different seeds (rank 0 as with seed=0, rank 1 as with "
                                      "seed=1)"),
    ({"resume_epoch": not_shuffled}, "in the data set's order"),
    ({"resume_epoch": one_batch_too_many}, "you skipped 1 batch; the checkpoint records 0 as trained"),
    ({"resume_epoch": last_batch_dropped}, "the epoch's last batch, of 3 images, is missing"),
    ({"resume_epoch": swapped}, "train_step got (labels, images)"),
]
