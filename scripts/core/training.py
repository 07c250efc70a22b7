"""The loop every script shares: one step, one epoch, exact evaluation, the whole fit."""
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import optim
from torch.optim.lr_scheduler import StepLR
from tqdm import tqdm

from . import reporting
from .data import as_tensors, evaluation_shard
from .distributed import unwrap

DEFAULT_LR = {"adadelta": 1.0, "adam": 2e-3, "sgd": 0.05}


def make_optimizer(model, args):
    """The optimizer and a per-epoch StepLR decay, as the pytorch/examples recipe has."""
    lr = args.lr or DEFAULT_LR[args.optimizer]
    if args.optimizer == "adadelta":
        optimizer = optim.Adadelta(model.parameters(), lr=lr)
    elif args.optimizer == "adam":
        optimizer = optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return optimizer, StepLR(optimizer, step_size=1, gamma=args.gamma)


def train_step(model, optimizer, images, labels, after_backward=None):
    """Forward, loss, backward, (gradient averaging), update. Returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.nll_loss(model(images), labels)
    loss.backward()
    if after_backward is not None:
        after_backward()  # the hand-written step averages gradients across ranks here
    optimizer.step()
    return loss.detach()


def train_epoch(model, batches, optimizer, runtime, after_backward=None, max_steps=None, description=""):
    """One pass over this process's batches. Returns (summed loss, samples seen) of this rank."""
    model.train()
    loss_sum = torch.zeros((), device=runtime.device)
    samples = 0
    show_bar = runtime.is_main and sys.stderr.isatty()
    for step, (images, labels) in enumerate(tqdm(batches, desc=description, disable=not show_bar, leave=False)):
        if max_steps is not None and step >= max_steps:
            break
        images = images.to(runtime.device, non_blocking=True)
        labels = labels.to(runtime.device, non_blocking=True)
        loss = train_step(model, optimizer, images, labels, after_backward)
        loss_sum += loss * len(labels)  # stays on the device: no sync per step
        samples += len(labels)
    return loss_sum, samples


def sum_over_ranks(values, runtime):
    """Element-wise sum of a list of numbers over all ranks (no-op in a world of one)."""
    totals = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.backend is not None:
        dist.all_reduce(totals)
    return totals.tolist()


class TestSet:
    """This rank's share of the test set as tensors: every world_size-th sample, no padding."""

    def __init__(self, dataset, runtime):
        images, labels = as_tensors(dataset)
        shard = torch.as_tensor(evaluation_shard(dataset, runtime.rank, runtime.world_size).indices)
        self.images, self.labels = images[shard].to(runtime.device), labels[shard].to(runtime.device)
        self.size = len(dataset)


@torch.no_grad()
def evaluate(model, test_set, runtime, batch_size):
    """Loss and accuracy over the whole test set, exactly, whatever the world size.

    Each rank scores its own shard in batches; the correct counts, summed losses and
    sample counts are then summed over ranks, so every test sample counts once.
    The plain model is used, not the DDP wrapper: a wrapped forward may sync
    buffers, and ranks whose shards differ by one batch would then wait forever.
    """
    model = unwrap(model)
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(test_set.labels), batch_size):
        images = test_set.images[start:start + batch_size]
        labels = test_set.labels[start:start + batch_size]
        log_probs = model(images)
        loss_sum += F.nll_loss(log_probs, labels, reduction="sum").item()
        correct += (log_probs.argmax(dim=1) == labels).sum().item()
    loss_sum, correct, total = sum_over_ranks([loss_sum, correct, len(test_set.labels)], runtime)
    assert int(total) == test_set.size, f"evaluated {int(total)} of {test_set.size} test samples"
    return {"test_loss": loss_sum / total, "test_accuracy": correct / total, "test_samples": int(total)}


def fit(script, model, optimizer, scheduler, batches, test_dataset, runtime, args, after_backward=None):
    """Train for ``args.epochs`` epochs, evaluating after each; returns the run's record.

    ``batches.sampler.set_epoch(epoch)`` reshuffles every epoch. Without it a
    DistributedSampler hands out the same order every epoch.
    """
    test_set = TestSet(test_dataset, runtime)
    run = reporting.RunLog(script, model, batches, runtime, args)
    for epoch in range(1, args.epochs + 1):
        batches.sampler.set_epoch(epoch)
        started = time.perf_counter()
        loss_sum, samples = train_epoch(model, batches, optimizer, runtime, after_backward,
                                        args.max_steps, description=f"epoch {epoch}")
        loss_sum, samples = sum_over_ranks([loss_sum.item(), samples], runtime)
        seconds = time.perf_counter() - started
        scheduler.step()
        metrics = evaluate(model, test_set, runtime, args.eval_batch_size)
        run.log_epoch(epoch, loss_sum / samples, int(samples), seconds, metrics)
    return run.finish()
