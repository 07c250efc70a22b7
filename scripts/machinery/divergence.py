"""A loss that is no longer finite stops the run. Machinery: a learner may skip this module.

A learning rate too high for the global batch (notebooks 02 and 04 teach raising both), or a precision too
narrow for the values, can turn the loss into inf or NaN; the weights follow, and a run that trains on ends
"successfully" with NaN weights. So (unless --train-through-nan):
- the graceful stop's agreement, the one all_reduce (MAX) every step boundary already makes, carries "my loss
  is not finite" too, computed on the device (graceful_stop.py): every rank stops after the same step, with
  no checkpoint of it and no extra synchronisation;
- a checkpoint is never written of a loss or of weights that are not finite (resume.py): the last good one
  stays the newest.
"""
import math

from kit import checkpoints
from kit.errors import CourseError
from kit.output_paths import display_path


def is_finite(number):
    return math.isfinite(float(number))


def not_finite(losses):
    """'nan on rank 1' for each rank whose loss is not finite."""
    return ", ".join(f"{loss} on rank {rank}" for rank, loss in enumerate(losses) if not is_finite(loss))


def stopped(what, trainer, folder):
    """The one line of a diverged run: ``what`` went wrong (and at which step); the likely causes, the way out."""
    args, world = trainer.args, trainer.runtime.world_size
    global_batch = trainer.batches.batch_size * world * args.accumulate
    newest = checkpoints.checkpoints_in(folder)
    kept = (f"the newest checkpoint, {display_path(newest[-1])}, is from before it" if newest
            else "no checkpoint was written")
    lr = trainer.optimizer.param_groups[0]["lr"]
    precision = "" if args.precision == "fp32" else f", or {args.precision}'s narrow range (try --precision fp32)"
    return CourseError(
        f"{what}: training stopped, and {kept}. Likely cause: a learning rate too high for the "
        f"global batch of {global_batch} (now {lr:g}: lower --lr, or add --warmup-steps with --lr-scaling linear)"
        f"{precision}. --train-through-nan trains on, to watch it")
