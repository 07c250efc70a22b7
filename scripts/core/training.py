"""The loop every training script shares: steps, epochs, exact evaluation, checkpoints.

A step script owns the lines that make it what it is: the process group, the sampler
and its ``set_epoch``, the wrap. It hands the rest to a ``Trainer``:

    trainer = training.Trainer("train_ddp", model, optimizer, scheduler, batches, test_set, runtime, args)
    for epoch in trainer.epochs():          # from where a resumed run stopped
        sampler.set_epoch(epoch)
        trainer.train_epoch(epoch)
    trainer.finish()

The Trainer checks the run's outputs and any checkpoint before training (on every rank
together), restores a checkpoint exactly, trains with gradient accumulation and mixed
precision when asked, checkpoints every ``--checkpoint-every`` steps and at every epoch
end, evaluates exactly, and turns a collective that times out into one line that says
which rank fell behind.
"""
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import optim
from torch.optim.lr_scheduler import StepLR
from tqdm import tqdm

from . import CourseError, checkpoint, faults, outputs, reporting
from .cli import REPO
from .data import as_tensors, evaluation_shard
from .distributed import Progress, agree, fail_together, gather_from_all_ranks, is_collective_failure, unwrap

DEFAULT_LR = {"adadelta": 1.0, "adam": 2e-3, "sgd": 0.05}

# Steps left out of the steady-state timing that MFU uses: the first steps of a process
# pay for memory allocation, kernel selection and the first communication set-up.
WARMUP_STEPS = 3


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
    """Forward, loss, backward, (gradient averaging), update. Returns the loss.

    The plain step, for demos and the equivalence check; the Trainer's step adds
    accumulation and mixed precision around the same four lines.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    if after_backward is not None:
        after_backward()  # the hand-written step averages gradients across ranks here
    optimizer.step()
    return loss.detach()


class Precision:
    """``--precision``: autocast for the forward pass and the loss; for fp16, a gradient scaler.

    bf16 keeps fp32's exponent range, so its gradients need no scaling; fp16's small
    gradients underflow to zero unless the loss is scaled up first (GradScaler).
    """

    DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, name, device):
        if name == "fp16" and device.type != "cuda":
            raise CourseError("--precision fp16 needs a CUDA GPU; on a CPU use --precision bf16 (or fp32)")
        self.name, self.dtype, self.device_type = name, self.DTYPES[name], device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


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
    """Loss and accuracy over the whole test set, exactly, whatever the world size.

    Each rank scores its own shard in batches; the correct counts, summed losses and
    sample counts are then summed over ranks, so every test sample counts once.
    The plain model is used, not the DDP wrapper: a wrapped forward may sync
    buffers, and ranks whose shards differ by one batch would then wait forever.
    Buffers (BatchNorm's running statistics) are first made rank 0's on every rank: each
    rank updated its own from its own batches since DDP last copied rank 0's, and rank 0's
    are the ones saved, so the scores are the saved model's. Training is unaffected
    (BatchNorm trains on each batch's own statistics, and DDP copies rank 0's anyway).
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


class Trainer:
    """Trains one run, epoch by epoch, from its start or from where a checkpoint left it."""

    def __init__(self, script, model, optimizer, scheduler, batches, test_set, runtime, args, after_backward=None):
        self.script, self.model, self.optimizer, self.scheduler = script, model, optimizer, scheduler
        self.batches, self.runtime, self.args, self.after_backward = batches, runtime, args, after_backward
        self.precision = Precision(args.precision, runtime.device)
        self.folder = Path(args.checkpoint_dir or REPO / "checkpoints" / (args.run_name or script))
        self.config = {"script": script, "model": args.model, "dataset": args.dataset, "world_size": runtime.world_size,
                       "batch_size": batches.batch_size, "accumulate": args.accumulate, "optimizer": args.optimizer,
                       "seed": args.seed, "precision": args.precision,
                       "trainable_parameters": sum(p.numel() for p in unwrap(model).parameters() if p.requires_grad)}
        # Where the run stands: the epoch in progress and its batches already trained.
        self.epoch, self.batches_done, self.global_step = 1, 0, 0
        self.resumed_partial = (0.0, 0)  # this rank's loss sum and samples of a resumed, unfinished epoch
        self.sampler_state = None  # a baseline shuffler's generator state at the start of self.epoch
        self.steps_this_process = 0
        self.progress = Progress(runtime)
        state, stale = self.check_before_training()
        torch.manual_seed(args.seed + runtime.rank)  # each rank its own dropout stream (restored below on resume)
        self.test_set = TestSet(test_set, runtime)
        self.log = reporting.RunLog(script, model, batches, runtime, args)
        if state is not None:
            self.load(state)
        elif stale and runtime.is_main:
            for path in stale:
                path.unlink(missing_ok=True)
            print(f"starting fresh: the finished run's checkpoints in {reporting.display_path(self.folder)} "
                  f"were removed", flush=True)
        self.progress.post(self.global_step, "starting", now=True)

    # ------------------------------------------------------------ before training

    def check_before_training(self):
        """Outputs writable, checkpoint readable and compatible, the same checkpoint on every rank: agreed by
        every rank.

        Returns (checkpoint state to resume from or None, a finished run's checkpoints to replace).
        """
        args = self.args
        with fail_together(self.runtime):
            if self.runtime.is_main:  # rank 0 alone writes
                outputs.check_folder(args.results_dir, "--results-dir")
                outputs.check_folder(self.folder, "--checkpoint-dir")
                if args.save:
                    outputs.check_file(args.save, "--save")
            path, state, stale = self.find_checkpoint()
        self.agree_on_checkpoint(path, state)
        if path is None and self.resume_from() == "latest" and self.runtime.is_main:
            print(f"no checkpoint in {reporting.display_path(self.folder)} yet: starting fresh", flush=True)
        return state, stale

    def resume_from(self):
        """None (start fresh), "latest" (the newest in the folder, if any) or a checkpoint file.
        A group that torchrun restarted resumes whatever its command line says."""
        return self.args.resume or (None if faults.first_attempt() else "latest")

    def find_checkpoint(self):
        """(the checkpoint this rank would resume from or None, its state, a finished run's checkpoints to replace)."""
        existing = checkpoint.checkpoints_in(self.folder)
        resume = self.resume_from()
        if resume is None:
            return None, None, self.finished_run(existing)
        if resume == "latest":
            if not existing:
                return None, None, []
            path = existing[-1]
        else:
            path = Path(resume)
        state = checkpoint.read(path, self.runtime.device)
        differ = checkpoint.differences(state["config"], self.config)
        if differ:
            raise CourseError(f"checkpoint {reporting.display_path(path)} is from another run ({differ}); resume with "
                              f"the same settings, or start fresh with another --checkpoint-dir")
        if len(state["ranks"]) != self.runtime.world_size:
            raise CourseError(f"checkpoint {path} holds {len(state['ranks'])} rank(s)' random state, "
                              f"this run has {self.runtime.world_size}")
        return path, state, []

    def agree_on_checkpoint(self, path, state):
        """Every rank resumes from the same checkpoint, or every rank starts fresh.

        Each rank looks for checkpoints in its own --checkpoint-dir. On nodes without a shared file system,
        rank 0 may find its own node's checkpoint while a rank elsewhere finds none (or an older one): trained
        on, those ranks would start from different weights and positions, and their collectives would no
        longer match. So the ranks compare what they found, and all stop with the same line if it differs.
        """
        found = None if path is None else (path.name, state["global_step"])
        view = (f"sees no checkpoint in {reporting.display_path(self.folder)}" if path is None else
                f"resumes from {reporting.display_path(path)} (step {state['global_step']})")
        fix = ("put --checkpoint-dir on a file system every node shares" if self.resume_from() == "latest" else
               "give --resume a file on a file system every node shares")
        agree(found, view, f"every rank must resume from the same checkpoint; {fix}")

    def finished_run(self, existing):
        """A fresh start may replace a finished run's checkpoints, never an unfinished one's."""
        if not existing:
            return []
        folder = reporting.display_path(self.folder)
        try:
            latest = checkpoint.read(existing[-1], "cpu")
        except CourseError:
            latest = {}
        if not latest.get("finished"):
            where = (f"epoch {latest['epoch']}, step {latest['global_step']}" if "epoch" in latest
                     else f"{existing[-1].name}")
            raise CourseError(f"{folder} holds an unfinished run (at {where}): add --resume to continue it, or pass "
                              f"another --checkpoint-dir (or delete that folder) to start over")
        return existing

    def load(self, state):
        """Put the model, optimizer, schedule, scaler, position and random streams back as saved."""
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.scaler.load_state_dict(state["scaler"])
        self.epoch, self.batches_done, self.global_step = state["epoch"], state["batches_done"], state["global_step"]
        mine = state["ranks"][self.runtime.rank]
        checkpoint.restore_rng_state(mine["rng"], self.runtime.device)
        self.resumed_partial = (mine["loss_sum"], mine["samples"])
        self.sampler_state = state["sampler_state"]
        self.log.restore(state["history"], state["train_seconds"])
        self.log.record["resumed_at_step"] = self.global_step
        if self.runtime.is_main:
            where = (f"epoch {self.epoch}, {self.batches_done} of {len(self.batches)} batches done"
                     if self.epoch <= self.args.epochs else f"all {self.epoch - 1} epochs done")
            print(f"resumed from {reporting.display_path(self.folder / checkpoint.file_name(self.global_step))}: "
                  f"{where}, step {self.global_step}", flush=True)

    # ------------------------------------------------------------ training

    def epochs(self):
        """The epochs still to train: all of them, or from where a resumed run stopped."""
        return range(self.epoch, self.args.epochs + 1)

    def train_epoch(self, epoch):
        """One epoch on this rank's batches, then exact evaluation, a log line and a checkpoint."""
        try:
            self.run_epoch(epoch)
        except RuntimeError as error:
            if self.runtime.world_size > 1 and is_collective_failure(error):
                raise CourseError(self.progress.explain_collective_failure(error, self.global_step)) from None
            raise

    def run_epoch(self, epoch):
        args, runtime = self.args, self.runtime
        skip = self.batches_done if epoch == self.epoch else 0
        loss_before, samples = self.resumed_partial if skip else (0.0, 0)
        self.epoch, self.batches_done = epoch, skip
        batches = self.start_shuffle(epoch, skip)
        limit = len(self.batches) if args.max_steps is None else min(len(self.batches), args.max_steps * args.accumulate)
        loss_sum = torch.zeros((), dtype=torch.float64, device=runtime.device)  # float64: a resumed epoch adds up the same
        started = steady_started = time.perf_counter()
        steady_from = samples if self.steps_this_process >= WARMUP_STEPS else None
        self.model.train()
        show_bar = runtime.is_main and sys.stderr.isatty()
        bar = tqdm(total=limit, initial=skip, desc=f"epoch {epoch}", disable=not show_bar, leave=False)
        for group in in_groups(batches, args.accumulate):
            group = group[: limit - self.batches_done]
            group = [(x.to(runtime.device, non_blocking=True), y.to(runtime.device, non_blocking=True)) for x, y in group]
            self.progress.post(self.global_step, "training")  # before the step's first collective
            loss_sum += self.step(group)
            samples += sum(len(labels) for _, labels in group)
            self.batches_done += len(group)
            self.global_step += 1
            self.steps_this_process += 1
            bar.update(len(group))
            if self.steps_this_process == WARMUP_STEPS:
                self.synchronize()
                steady_started, steady_from = time.perf_counter(), samples
            self.progress.post(self.global_step, "between steps")
            last = self.batches_done >= limit
            if not last and args.checkpoint_every and self.global_step % args.checkpoint_every == 0:
                self.save_checkpoint(loss_before + loss_sum.item(), samples)  # the epoch's end has its own
            faults.after_step(args, runtime.rank, self.global_step)  # a drill strikes after the step's checkpoint
            if last:
                break
        bar.close()
        self.end_epoch(epoch, loss_before + loss_sum.item(), samples, started, steady_started, steady_from)

    def step(self, group):
        """One optimizer step over a group of batches (``--accumulate`` of them).

        Each batch's loss is weighted by its share of the group's samples, so the summed
        gradients are those of one batch holding all of them. Gradients are synchronised
        once, after the last batch: a model with ``no_sync`` (DDP) skips its all_reduce
        for the others, and the hand-written averaging runs once, after backward.
        """
        self.optimizer.zero_grad(set_to_none=True)
        total = sum(len(labels) for _, labels in group)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        for index, (images, labels) in enumerate(group):
            last = index == len(group) - 1
            with self.skip_gradient_sync(not last):  # DDP decides in forward whether backward syncs
                with self.precision.autocast():
                    loss = F.cross_entropy(self.model(images), labels)
                self.precision.scaler.scale(loss * (len(labels) / total)).backward()
            loss_sum += loss.detach().double() * len(labels)
        if self.after_backward is not None:
            self.after_backward()
        self.precision.scaler.step(self.optimizer)
        self.precision.scaler.update()
        return loss_sum

    def skip_gradient_sync(self, skip):
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if skip and no_sync is not None else contextlib.nullcontext()

    def start_shuffle(self, epoch, skip):
        """This epoch's batches. A baseline's shuffler (a sampler with its own generator) is
        put back to its state at the start of this epoch when resuming, so the order is the
        one the interrupted run had; a DistributedSampler's order depends on set_epoch alone."""
        generator = getattr(self.batches.sampler, "generator", None)
        if generator is not None:
            if self.sampler_state is not None:
                generator.set_state(self.sampler_state.cpu())
            self.sampler_state = generator.get_state()
        loader_seed = (self.args.seed * 1_000_003 + epoch) * 1_009 + self.runtime.rank
        return self.batches.iterate(skip, seed=loader_seed)

    def end_epoch(self, epoch, loss_sum, samples, started, steady_started, steady_from):
        self.progress.post(self.global_step, "ending the epoch")
        steady_samples = samples - steady_from if steady_from is not None else 0
        loss_sum, samples, steady_samples = sum_over_ranks([loss_sum, samples, steady_samples], self.runtime)
        self.synchronize()
        now = time.perf_counter()
        self.scheduler.step()
        metrics = evaluate(self.model, self.test_set, self.runtime, self.args.eval_batch_size)
        metrics["first_indices"] = self.batches.order[:8].tolist()  # rank 0's data order, to check set_epoch
        steady = (int(steady_samples), now - steady_started) if steady_from is not None else None
        self.log.log_epoch(epoch, loss_sum / samples, int(samples), now - started, metrics, steady=steady)
        generator = getattr(self.batches.sampler, "generator", None)
        self.sampler_state = generator.get_state() if generator is not None else None
        self.epoch, self.batches_done = epoch + 1, 0
        self.save_checkpoint()

    def synchronize(self):
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)

    # ------------------------------------------------------------ checkpoints and the end

    def save_checkpoint(self, loss_sum=0.0, samples=0):
        """Every rank hands rank 0 its random state; rank 0 writes the file atomically."""
        mine = {"rng": checkpoint.rng_state(self.runtime.device), "loss_sum": float(loss_sum), "samples": int(samples)}
        ranks = gather_from_all_ranks(mine)
        if not self.runtime.is_main:
            return
        state = {
            "format": checkpoint.FORMAT, "config": self.config,
            "model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.precision.scaler.state_dict(),
            "epoch": self.epoch, "batches_done": self.batches_done, "global_step": self.global_step,
            "finished": self.epoch > self.args.epochs, "ranks": ranks, "sampler_state": self.sampler_state,
            "history": self.log.record["per_epoch"], "train_seconds": self.log.elapsed(),
        }
        path = self.folder / checkpoint.file_name(self.global_step)
        crash = faults.crash_while_saving(self.args, self.runtime.rank, self.global_step)
        if crash:
            print(f"fault drill: rank 0 dies halfway through writing {path.name}", flush=True)
        checkpoint.write_atomically(state, path, crash_midway=crash)
        checkpoint.prune(self.folder, self.args.keep_checkpoints)
        where = f"end of epoch {self.epoch - 1}" if self.batches_done == 0 else f"epoch {self.epoch}, step {self.global_step}"
        print(f"checkpoint {reporting.display_path(path)} ({where})", flush=True)

    def finish(self):
        """Write the run's record and, with --save, the final weights (rank 0); return the record."""
        record = self.log.finish()
        if self.args.save:
            if self.runtime.is_main:
                checkpoint.save_weights(unwrap(self.model), self.args.save)
                print(f"saved the final weights to {reporting.display_path(self.args.save)}", flush=True)
            if self.runtime.distributed:
                dist.barrier()  # nobody reads the file before rank 0 has written it
        self.progress.post(self.global_step, "finished", now=True)
        self.progress.close()
        return record
