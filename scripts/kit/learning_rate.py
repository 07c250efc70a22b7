"""The learning rate when the global batch grows: ``--lr-scaling`` and ``--warmup-steps``. Kit: a
learner may skip this module (notebooks 02, 04 and 06 teach what it does).

``--batch-size`` is per process. With N processes and ``--accumulate K``, one optimizer step averages the
gradient over N x K times as many images (DataParallel: over its GPUs' share too), and an epoch takes N x K
times fewer steps. With the same learning rate that is a different optimisation from the one-process run.

``--lr-scaling linear`` applies the linear scaling rule of Goyal et al. 2017, "Accurate, Large Minibatch SGD:
Training ImageNet in 1 Hour" (https://arxiv.org/abs/1706.02677): "When the minibatch size is multiplied by
k, multiply the learning rate by k." Here k is the global batch of one optimizer step over ``--batch-size``,
so ``--lr`` (or the optimizer's default) is the rate for one process's batch, and every world size gets the
rate the rule gives it from the same command line. The paper pairs the rule with a gradual warm-up: the rate
starts at the unscaled value and rises by the same amount every step to k times it (the paper: over 5
epochs). ``--warmup-steps N`` does that over the first N optimizer steps. The rule was established for SGD
with momentum; for Adam and Adadelta it is a starting point to check against the accuracy, not a result.

``--lr-scaling none`` (the default) keeps the rate as given. To keep the training itself unchanged instead,
hold the global batch: ``--batch-size 64/N`` on N processes, or ``--accumulate N`` on one.
"""
from torch.optim.lr_scheduler import StepLR


def scaling_factor(lr_scaling, global_batch, batch_size):
    """k of the linear rule: ``global_batch``, the images of one optimizer step over every process (this process's
    batch, per GPU times the GPUs for DataParallel, x the processes x --accumulate), over --batch-size. 1 without
    --lr-scaling linear, or without a global batch (demos and checks that build an optimizer alone)."""
    if global_batch is None or lr_scaling == "none":
        return 1.0
    return global_batch / batch_size


class WarmupStepLR(StepLR):
    """StepLR (decay by ``gamma`` every ``step_size`` steps) after a linear warm-up: at step t < ``warmup_steps``
    the rate is base x (1/k + (1 - 1/k) t / warmup_steps), so it starts at the unscaled rate base/k and
    gains the same amount every step (the gradual warm-up of Goyal et al. 2017)."""

    def __init__(self, optimizer, step_size, gamma, factor, warmup_steps):
        self.factor, self.warmup_steps = factor, warmup_steps
        super().__init__(optimizer, step_size=step_size, gamma=gamma)

    def get_lr(self):
        decay = self.gamma ** (self.last_epoch // self.step_size)
        return [base * self.warmup() * decay for base in self.base_lrs]

    def warmup(self):
        if self.last_epoch >= self.warmup_steps:
            return 1.0
        start = 1.0 / self.factor
        return start + (1.0 - start) * self.last_epoch / self.warmup_steps


def schedule(optimizer, steps_per_epoch, gamma, factor, warmup_steps):
    """The schedule make_optimizer returns: the --gamma decay once an epoch, after any warm-up."""
    if factor != 1 and warmup_steps:
        return WarmupStepLR(optimizer, steps_per_epoch, gamma, factor, warmup_steps)
    return StepLR(optimizer, step_size=steps_per_epoch, gamma=gamma)


def describe(rate, factor, batch_size, warmup_steps):
    """'learning rate 0.004 = 2 x 0.002 (--lr-scaling linear: global batch 128 / --batch-size 64), ...'."""
    base = rate / factor
    warmup = f", reached after {warmup_steps} warm-up steps from {base:g}" if factor != 1 and warmup_steps else ""
    return (f"learning rate {rate:g} = {factor:g} x {base:g} (--lr-scaling linear: global batch "
            f"{factor * batch_size:g} / --batch-size {batch_size}){warmup}")
