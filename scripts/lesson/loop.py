"""The training loop every step script shares: the step, the epoch, exact evaluation.

A step script owns the lines that make it that step (the process group, the sampler and its set_epoch,
the wrap) and hands the rest to a Trainer. What a real job adds around the loop (the line per epoch and
the run's record, checkpoints and resuming, fault drills, finding a stalled rank, a progress bar) plugs
in as callbacks, called at the points ``Callback`` names; machinery/job.py lists them, and a learner may
skip them all.
"""
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import optim

from kit import checkpoints, learning_rate
from kit.datasets import as_tensors
from kit.output_paths import display_path
from kit.precision import Precision

from .data import epoch_seed, evaluation_shard
from .models import unwrap

DEFAULT_LR = {"adadelta": 1.0, "adam": 2e-3, "sgd": 0.05}


def make_optimizer(model, args, batches=None, runtime=None):
    """The optimizer and its learning-rate schedule, which the Trainer steps after every optimizer step:
    the pytorch/examples recipe's decay by --gamma once an epoch, counted in steps (without ``batches``:
    once per ``scheduler.step()``). A schedule that changes every step goes here, not into the loop.
    --lr-scaling linear multiplies the rate by the global batch / --batch-size, after --warmup-steps; with
    ``batches``, ``runtime`` gives the world size, and rank 0 alone says which rate the rule gave."""
    # The global batch: the images of one optimizer step over every process (a demo without batches has none).
    global_batch = None if batches is None else batches.batch_size * runtime.world_size * args.accumulate
    factor = learning_rate.scaling_factor(args.lr_scaling, global_batch, args.batch_size)  # 1 but for linear
    lr = (args.lr or DEFAULT_LR[args.optimizer]) * factor
    if args.optimizer == "adadelta":
        optimizer = optim.Adadelta(model.parameters(), lr=lr)
    elif args.optimizer == "adam":
        optimizer = optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    steps = 1 if batches is None else steps_per_epoch(batches, args)
    if args.lr_scaling == "linear" and (runtime is None or runtime.is_main):
        print(learning_rate.describe(lr, factor, args.batch_size, args.warmup_steps), flush=True)
    return optimizer, learning_rate.schedule(optimizer, steps, args.gamma, factor, args.warmup_steps)


def steps_per_epoch(batches, args):
    return -(-batches_per_epoch(batches, args) // args.accumulate)  # the last step may take fewer batches


def batches_per_epoch(batches, args):
    return len(batches) if args.max_steps is None else min(len(batches), args.max_steps * args.accumulate)


def train_step(model, optimizer, images, labels, after_backward=None):
    """Forward, loss, backward, (gradient averaging), update: the plain step, for demos and checks.
    The Trainer's step adds accumulation and mixed precision around the same lines."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    if after_backward is not None:
        after_backward()  # the hand-written step averages gradients across ranks here
    optimizer.step()
    return loss.detach()


class Callback:
    """Where a job's machinery plugs into the loop: every rank calls the same callbacks at the same points,
    in list order, and a point does nothing unless a callback overrides it. The points: before the first
    epoch (a resume moves the Trainer's position there), before an epoch, before a step's first collective,
    after its optimizer step, before the epoch's closing sums and evaluation, after them, after training."""

    def on_train_start(self, trainer): pass
    def on_epoch_start(self, trainer): pass
    def on_step_start(self, trainer): pass
    def on_step_end(self, trainer): pass
    def on_evaluation_start(self, trainer): pass
    def on_epoch_end(self, trainer, metrics): pass
    def on_train_end(self, trainer): pass


class Trainer:
    """Trains one run, epoch by epoch, from its start or from where a resumed run stopped."""

    def __init__(self, model, optimizer, scheduler, batches, test_set, runtime, args, after_backward=None,
                 callbacks=()):
        self.model, self.optimizer, self.scheduler, self.batches = model, optimizer, scheduler, batches
        self.runtime, self.args, self.after_backward, self.callbacks = runtime, args, after_backward, list(callbacks)
        self.precision = Precision(args.precision, runtime.device)  # --precision: autocast, and fp16's scaler
        self.epoch, self.batches_done, self.global_step = 1, 0, 0  # where the run stands
        self.started = False
        self.loss_sum, self.samples = 0.0, 0  # this rank's, over the epoch so far
        self.step_loss = None  # this rank's summed loss of the last step, on its device
        torch.manual_seed(args.seed + runtime.rank)  # each rank its own dropout masks
        self.test_set = TestSet(test_set, runtime)

    def notify(self, point, *details):
        for callback in self.callbacks:
            getattr(callback, point)(self, *details)

    def start(self):
        """Before the first epoch, the callbacks check the outputs and may resume: with --resume, or in a group
        torchrun restarted, the weights, optimizer and position come back from a checkpoint (machinery/resume.py)."""
        self.notify("on_train_start")
        self.started = True

    def epochs(self):
        """The epochs still to train: all of them, or from where a resumed run stopped."""
        if not self.started:
            raise RuntimeError("call trainer.start() before trainer.epochs(): it decides where the run starts")
        return range(self.epoch, self.args.epochs + 1)

    def train_epoch(self, epoch):
        """This rank's batches of one epoch (less those a resumed run trained already), then evaluation."""
        self.epoch, self.epoch_batches = epoch, batches_per_epoch(self.batches, self.args)
        self.notify("on_epoch_start")
        started, samples_before = time.perf_counter(), self.samples  # a resumed epoch's first part was trained before
        self.model.train()
        batches = self.batches.iterate(self.batches_done, seed=epoch_seed(self.args.seed, epoch, self.runtime.rank))
        for group in in_groups(batches, self.args.accumulate):
            group = [(x.to(self.runtime.device, non_blocking=True), y.to(self.runtime.device, non_blocking=True))
                     for x, y in group[: self.epoch_batches - self.batches_done]]
            self.notify("on_step_start")
            self.step_loss = self.step(group)
            self.loss_sum += self.step_loss
            self.samples += sum(len(labels) for _, labels in group)
            self.batches_done += len(group)
            self.global_step += 1
            self.notify("on_step_end")
            if self.batches_done >= self.epoch_batches:
                break
        self.end_epoch(epoch, started, samples_before)

    def step(self, group):
        """One optimizer step over a group of batches (``--accumulate`` of them); returns their summed loss.

        Each batch's loss is weighted by its share of the group's samples, so the summed gradients are
        those of one batch holding all of them. Gradients are synchronised once, after the last batch:
        DDP's ``no_sync`` skips the all_reduce for the others, and the hand-written averaging runs once.
        """
        self.optimizer.zero_grad(set_to_none=True)
        total = sum(len(labels) for _, labels in group)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        for index, (images, labels) in enumerate(group):
            with skip_gradient_sync(self.model, index < len(group) - 1):  # DDP decides in forward
                with self.precision.autocast():
                    loss = F.cross_entropy(self.model(images), labels)
                self.precision.scaler.scale(loss * (len(labels) / total)).backward()
            loss_sum += loss.detach().double() * len(labels)
        if self.after_backward is not None:
            self.after_backward()  # the hand-written step averages gradients across ranks here
        self.precision.scaler.step(self.optimizer)
        self.precision.scaler.update()
        self.scheduler.step()
        return loss_sum

    def end_epoch(self, epoch, started, samples_before):
        """The epoch's loss and samples summed over ranks, exact evaluation, then the callbacks. ``trained_samples``:
        those this run trained in ``seconds`` (a resumed epoch's ``samples`` count those before the resume too)."""
        self.notify("on_evaluation_start")
        trained = self.samples - samples_before
        loss_sum, samples, trained = sum_over_ranks([float(self.loss_sum), self.samples, trained], self.runtime)
        synchronize(self.runtime.device)
        metrics = {"epoch": epoch, "train_loss": loss_sum / samples, "samples": int(samples),
                   "trained_samples": int(trained), "seconds": time.perf_counter() - started,
                   **evaluate(self.model, self.test_set, self.runtime, self.args.eval_batch_size),
                   "first_indices": self.batches.order[:8].tolist()}  # rank 0's data order, to check set_epoch
        self.epoch, self.batches_done, self.loss_sum, self.samples = epoch + 1, 0, 0.0, 0
        self.notify("on_epoch_end", metrics)  # rank 0 prints the epoch's line (machinery/reporting.py)

    def finish(self):
        """Rank 0 writes the run's record (a callback) and, with --save, the final weights."""
        self.notify("on_train_end")
        if self.args.save:
            if self.runtime.is_main:  # the plain model's weights: no "module." prefix in their names
                checkpoints.save_weights(unwrap(self.model), self.args.save)
                print(f"saved the final weights to {display_path(self.args.save)}", flush=True)
            if self.runtime.distributed:
                dist.barrier()  # nobody reads the file before rank 0 has written it


def skip_gradient_sync(model, skip):
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if skip and no_sync is not None else contextlib.nullcontext()


def in_groups(items, size):
    """[a, b, c, d, e] in groups of 2 -> [a, b], [c, d], [e]."""
    group = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sum_over_ranks(values, runtime):
    """Element-wise sum of a list of numbers over all ranks (no-op in a world of one)."""
    totals = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.distributed:
        dist.all_reduce(totals)
    return totals.tolist()


class TestSet:
    """This rank's share of the test set as tensors: every world_size-th sample, no padding.
    Each rank converts only its own share (an ImageFolder's images one by one, through
    the data set's evaluation transform)."""

    def __init__(self, dataset, runtime):
        images, labels = as_tensors(evaluation_shard(dataset, runtime.rank, runtime.world_size))
        self.images, self.labels = images.to(runtime.device), labels.to(runtime.device)
        self.size = len(dataset)


@torch.no_grad()
def evaluate(model, test_set, runtime, batch_size):
    """Loss and accuracy over the whole test set, exactly, whatever the world size: each rank scores its
    shard, then the sums are summed over ranks, so every test sample counts once.

    The plain model, not the DDP wrapper: a wrapped forward may sync buffers, and ranks whose shards differ
    by one batch would wait forever. Buffers (BatchNorm's running statistics) are made rank 0's first, so
    the scores are those of the model rank 0 saves.
    """
    model = unwrap(model)
    if runtime.distributed and dist.get_world_size() > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(test_set.labels), batch_size):
        images = test_set.images[start:start + batch_size]
        labels = test_set.labels[start:start + batch_size]
        logits = model(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
    model.train(was_training)
    loss_sum, correct, total = sum_over_ranks([loss_sum, correct, len(test_set.labels)], runtime)
    assert int(total) == test_set.size, f"evaluated {int(total)} of {test_set.size} test samples"
    return {"test_loss": loss_sum / total, "test_accuracy": correct / total, "test_samples": int(total)}
