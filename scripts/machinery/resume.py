"""When a run resumes and when it saves: the checkpointing callback. Machinery: a learner may skip this
module (notebook 05 teaches it).

Before the first epoch, every rank together:
- checks that the run's outputs can be written (results, checkpoints, --save), that the checkpoint folder has
  room for the checkpoints the run keeps, and takes that folder (one run per folder: folder_lock.py);
- decides, in one call (``decide``), whether to resume and from which checkpoint: ``--resume``
  (the newest in --checkpoint-dir, or a file), or a group that torchrun restarted, which always
  resumes; a fresh start refuses a folder holding an unfinished run (``--start-over`` moves that run's
  checkpoints aside instead) and replaces a finished one's;
- agrees on it: every rank resumes from the same checkpoint, or every rank stops with one line;
- puts the model, optimizer, schedule, scaler, position and random streams back as saved.

While training: a checkpoint every ``--checkpoint-every`` steps and at every epoch's end, written by
rank 0 (kit/checkpoints.py) with every rank's random state, through the writer job.py hands it. A write that
fails (a full disk, a quota) stops every rank after that step with one line; one of a loss or of weights that
are no longer finite is never written (divergence.py).
"""
import contextlib
import time
from pathlib import Path

import torch

from kit import checkpoints, launch_checks, output_paths
from kit.agreement import agree, fail_together, gather_from_all_ranks
from kit.errors import CourseError
from kit.output_paths import display_path
from lesson.loop import Callback, batches_per_epoch, steps_per_epoch
from lesson.models import unwrap

from . import divergence, folder_lock

FAILED_NOTE = "FAILED"  # in the checkpoint folder: the line of a run that stopped where a restart would stop again


class Checkpointing(Callback):
    """``folder``: where the checkpoints go (job.py resolves it); ``write(state, path)``: what writes one file
    (kit/checkpoints.py's atomic write, or a fault drill's)."""

    def __init__(self, script, args, runtime, record, folder, write):
        self.script, self.args, self.runtime, self.record = script, args, runtime, record
        self.folder, self.write = folder, write
        self.sampler_state = None  # a baseline shuffler's generator state at the start of the epoch in progress
        self.config = None
        self.saved_step = None  # the step of the newest checkpoint this run wrote
        self.lock = None  # rank 0's lock on the folder
        self.checkpoint_bytes = None  # about the size of one checkpoint
        self.longest_save = 0.0  # seconds the longest checkpoint of this run took (the graceful stop plans with it)

    # ------------------------------------------------------------ before training

    def on_train_start(self, trainer):
        self.config = run_config(self.script, trainer)
        self.checkpoint_bytes = checkpoints.estimated_bytes(unwrap(trainer.model), self.args.optimizer)
        state = self.decide(trainer)
        if state is not None:
            self.load(trainer, state)

    def on_train_end(self, trainer):
        if self.lock is not None:
            self.lock.release()

    def decide(self, trainer):
        """The one resume decision, agreed by every rank after the outputs are checked, the folder taken, and its
        room for the checkpoints still to come checked: the state of the checkpoint to resume from, or None to start
        fresh (a finished run's checkpoints are replaced)."""
        args = self.args
        with fail_together(self.runtime):
            if self.runtime.is_main:  # rank 0 alone writes
                output_paths.check_folder(args.results_dir, "--results-dir")
                output_paths.check_folder(self.folder, "--checkpoint-dir")
                self.lock = folder_lock.take(self.folder)  # before anything is read there
                self.check_earlier_failure()
                if args.save:
                    output_paths.check_file(args.save, "--save")
            path, state, stale = self.find_checkpoint()
            if self.runtime.is_main:
                kept = len(checkpoints.checkpoints_in(self.folder)) - len(stale)  # a finished run's are replaced
                at_once = min(args.keep_checkpoints + 1, kept + checkpoints_to_write(trainer, state))
                checkpoints.check_room(self.folder, self.checkpoint_bytes, at_once, args.keep_checkpoints, stale)
        self.agree_on_checkpoint(path, state)
        if path is None and self.resume_from() == "latest" and self.runtime.is_main:
            print(f"no checkpoint in {display_path(self.folder)} yet: starting fresh", flush=True)
        if stale and self.runtime.is_main:
            self.clear(stale)
        return state

    def check_earlier_failure(self):
        """A group torchrun restarted after a divergence or a failed write would meet it again from the same
        checkpoint: it stops at once with the same line. A new launch (its first attempt) tries again."""
        note = self.folder / FAILED_NOTE
        if not note.is_file():
            return
        if launch_checks.first_attempt():
            note.unlink(missing_ok=True)
            return
        raise CourseError(f"{note.read_text().strip()} [this group, restarted by torchrun, would meet it again and "
                          f"stops: fix the cause, then start the job again]")

    def failed(self, error):
        """``error`` (a divergence, a write that failed), noted in the folder by rank 0 for a restarted group."""
        if self.runtime.is_main:
            with contextlib.suppress(OSError):  # a full disk may refuse the note too
                (self.folder / FAILED_NOTE).write_text(f"{error}\n")
        return error

    def clear(self, stale):
        """A finished run's checkpoints are removed; an unfinished one's (--start-over) are moved aside."""
        if not self.args.start_over:
            for old in stale:
                old.unlink(missing_ok=True)
            print(f"starting fresh: the finished run's checkpoints in {display_path(self.folder)} were removed",
                  flush=True)
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.folder / f"set-aside-{stamp}"
        for number in range(2, 1000):
            if not aside.exists():
                break
            aside = self.folder / f"set-aside-{stamp}-{number}"
        aside.mkdir()
        for old in stale:
            old.rename(aside / old.name)
        print(f"starting over: the earlier run's {len(stale)} checkpoint(s) were moved to {display_path(aside)}",
              flush=True)

    def resume_from(self):
        """None (start fresh), "latest" (the newest in the folder, if any) or a checkpoint file.
        A group that torchrun restarted resumes whatever its command line says."""
        return self.args.resume or (None if launch_checks.first_attempt() else "latest")

    def find_checkpoint(self):
        """(the checkpoint this rank would resume from or None, its state, a finished run's checkpoints to replace)."""
        existing = checkpoints.checkpoints_in(self.folder)
        resume = self.resume_from()
        if resume is None:
            return None, None, self.finished_run(existing)
        if resume == "latest":
            if not existing:
                return None, None, []
            path = existing[-1]
        else:
            path = Path(resume)
        state = checkpoints.read(path, self.runtime.device)
        differ = checkpoints.differences(state["config"], self.config)
        if differ:
            raise CourseError(f"checkpoint {display_path(path)} is from another run ({differ}); resume with "
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
        view = (f"sees no checkpoint in {display_path(self.folder)}" if path is None else
                f"resumes from {display_path(path)} (step {state['global_step']})")
        fix = ("put --checkpoint-dir on a file system every node shares" if self.resume_from() == "latest" else
               "give --resume a file on a file system every node shares")
        agree(found, view, f"every rank must resume from the same checkpoint; {fix}")

    def finished_run(self, existing):
        """A fresh start may replace a finished run's checkpoints, never an unfinished one's (--start-over
        moves those aside)."""
        if not existing:
            return []
        folder = display_path(self.folder)
        try:
            latest = checkpoints.read(existing[-1], "cpu")
        except CourseError:
            latest = {}
        if not latest.get("finished") and not self.args.start_over:
            where = (f"epoch {latest['epoch']}, step {latest['global_step']}" if "epoch" in latest
                     else f"{existing[-1].name}")
            raise CourseError(f"{folder} holds an unfinished run (at {where}): add --resume to continue it, or "
                              f"--start-over to start a fresh run there "
                              f"(its checkpoints are moved aside, not deleted), "
                              f"or pass another --checkpoint-dir")
        return existing

    def load(self, trainer, state):
        """Put the model, optimizer, schedule, scaler, position and random streams back as saved."""
        unwrap(trainer.model).load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        trainer.precision.scaler.load_state_dict(state["scaler"])
        trainer.epoch, trainer.batches_done, trainer.global_step = (state["epoch"], state["batches_done"],
                                                                    state["global_step"])
        mine = state["ranks"][self.runtime.rank]
        checkpoints.restore_rng_state(mine["rng"], self.runtime.device)
        trainer.loss_sum, trainer.samples = mine["loss_sum"], mine["samples"]
        self.sampler_state = state["sampler_state"]
        self.record.restore(state["history"], state["train_seconds"], resumed_at_step=trainer.global_step)
        if self.runtime.is_main:  # of the epoch's batches: --max-steps may end it early
            epoch_batches = batches_per_epoch(trainer.batches, self.args)
            where = (f"epoch {trainer.epoch}, {trainer.batches_done} of {epoch_batches} batches done"
                     if trainer.epoch <= self.args.epochs else f"all {trainer.epoch - 1} epochs done")
            print(f"resumed from {display_path(self.folder / checkpoints.file_name(trainer.global_step))}: "
                  f"{where}, step {trainer.global_step}", flush=True)

    # ------------------------------------------------------------ while training

    def on_epoch_start(self, trainer):
        """A baseline's shuffler (a sampler with its own generator) is put back to its state at the start of
        this epoch when resuming, so the order is the one the interrupted run had; a DistributedSampler's
        order depends on set_epoch alone."""
        generator = shuffling_generator(trainer)
        if generator is not None:
            if self.sampler_state is not None:
                generator.set_state(self.sampler_state.cpu())
            self.sampler_state = generator.get_state()

    def on_step_end(self, trainer):
        last = trainer.batches_done >= trainer.epoch_batches  # the epoch's end has its own checkpoint
        if not last and self.args.checkpoint_every and trainer.global_step % self.args.checkpoint_every == 0:
            self.save(trainer)

    def on_epoch_end(self, trainer, metrics):
        generator = shuffling_generator(trainer)
        self.sampler_state = generator.get_state() if generator is not None else None
        self.save(trainer)

    def save(self, trainer):
        """Every rank hands rank 0 its random state and loss; rank 0 writes the file atomically, and every rank
        learns whether it could. Timed, on every rank."""
        started = time.perf_counter()
        if self.write_checkpoint(trainer):
            self.saved_step = trainer.global_step
        self.longest_save = max(self.longest_save, time.perf_counter() - started)

    def write_checkpoint(self, trainer):
        """True once written; False where --train-through-nan leaves out a checkpoint of non-finite values."""
        mine = {"rng": checkpoints.rng_state(self.runtime.device), "loss_sum": float(trainer.loss_sum),
                "samples": int(trainer.samples)}
        last_loss = 0.0 if trainer.step_loss is None else float(trainer.step_loss)  # the epoch's end reset loss_sum
        gathered = gather_from_all_ranks((mine, last_loss))
        ranks = [theirs for theirs, _ in gathered]
        losses = [theirs["loss_sum"] + last for theirs, last in gathered]  # every rank sees all: they agree
        if not all(map(divergence.is_finite, losses)):
            return self.refuse(trainer, f"the training loss is not finite ({divergence.not_finite(losses)})")
        if not weights_finite(trainer.model):  # the same weights on every rank: every rank decides alike
            return self.refuse(trainer, "the model's weights are not finite")
        with fail_together(self.runtime):  # a failed write stops every rank after this step, with one line
            if self.runtime.is_main:
                self.lock.check()  # still this run's folder
                self.write_file(trainer, ranks)
        return True

    def write_file(self, trainer, ranks):
        state = {
            "format": checkpoints.FORMAT, "config": self.config,
            "model": unwrap(trainer.model).state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(), "scaler": trainer.precision.scaler.state_dict(),
            "epoch": trainer.epoch, "batches_done": trainer.batches_done, "global_step": trainer.global_step,
            "finished": trainer.epoch > self.args.epochs, "ranks": ranks, "sampler_state": self.sampler_state,
            "history": self.record.history, "train_seconds": self.record.elapsed(),
        }
        path = self.folder / checkpoints.file_name(trainer.global_step)
        try:
            self.write(state, path)
        except OSError as error:
            raise self.failed(checkpoints.write_failed(error, path, self.checkpoint_bytes,
                                                       self.args.keep_checkpoints)) from None
        checkpoints.prune(self.folder, self.args.keep_checkpoints)
        where = (f"end of epoch {trainer.epoch - 1}" if trainer.batches_done == 0
                 else f"epoch {trainer.epoch}, step {trainer.global_step}")
        print(f"checkpoint {display_path(path)} ({where})", flush=True)

    def refuse(self, trainer, what):
        """No checkpoint of a diverged run: stop, or with --train-through-nan train on without it."""
        if not self.args.train_through_nan:
            raise self.failed(divergence.stopped(f"{what} at step {trainer.global_step}, where a checkpoint was due",
                                                 trainer, self.folder))
        if self.runtime.is_main:
            print(f"checkpoint of step {trainer.global_step} not written: {what} (--train-through-nan)", flush=True)
        return False


def run_config(script, trainer):
    """What identifies a run; checkpoints.MUST_MATCH names what a resumed run must share with it."""
    args = trainer.args
    return {"script": script, "model": args.model, "dataset": args.dataset, "world_size": trainer.runtime.world_size,
            "batch_size": trainer.batches.batch_size, "accumulate": args.accumulate, "optimizer": args.optimizer,
            "seed": args.seed, "precision": args.precision,
            "trainable_parameters": sum(p.numel() for p in unwrap(trainer.model).parameters() if p.requires_grad)}


def checkpoints_to_write(trainer, state):
    """About how many checkpoints the run writes from ``state`` (None: its start) on: each epoch's end, and every
    --checkpoint-every steps."""
    args = trainer.args
    steps = steps_per_epoch(trainer.batches, args)
    every = args.checkpoint_every
    epoch, done = (1, 0) if state is None else (state["epoch"], -(-state["batches_done"] // args.accumulate))
    per_epoch = 1 + ((steps - 1) // every if every else 0)  # the epoch's last step has the epoch's checkpoint
    behind = done // every if every else 0  # those of the epoch in progress already written
    return max(0, (args.epochs - epoch + 1) * per_epoch - behind)


def weights_finite(model):
    """The parameters, which every rank holds alike (buffers such as BatchNorm's statistics may differ by rank)."""
    return all(bool(parameter.isfinite().all()) for parameter in unwrap(model).parameters())


def shuffling_generator(trainer):
    """The generator of a baseline's RandomSampler; None for a DistributedSampler."""
    generator = getattr(trainer.batches.sampler, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None
