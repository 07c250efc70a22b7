"""The check of 05_checkpoints_and_faults.ipynb's exercise: the checkpoint a restarted group resumes from. Notebook
support: a learner may skip this module.
"""
from .registry import exercise

# (--checkpoint-every, steps per epoch, the step after which a rank dies): the checkpoint a restart resumes from
RESUME_CASES = [(4, 6, 10), (4, 6, 7), (4, 6, 8), (5, 3, 4), (100, 50, 149), (3, 10, 2)]


def newest_checkpoint_step(checkpoint_every, steps_per_epoch, fault_step):
    """What the Trainer does: a checkpoint every N global steps and one at each epoch's end;
    a fault drill strikes after the step's checkpoint. 0: none yet, a fresh start."""
    saved = [step for step in range(1, fault_step + 1)
             if step % checkpoint_every == 0 or step % steps_per_epoch == 0]
    return max(saved, default=0)


@exercise(1, answers=("resume_step",))
def check_resume_step(resume_step, observed=None):
    for case in RESUME_CASES:
        expected = newest_checkpoint_step(*case)
        got = resume_step(*case)
        assert got == expected, (f"resume_step{case} = {got}: which checkpoints exist after step {case[2]}? "
                                 "Count those every N steps and those at the end of each epoch")
    if observed is not None:  # the run the notebook killed: what its restarted group printed
        case = (observed["checkpoint_every"], observed["steps_per_epoch"], observed["fault_step"])
        assert resume_step(*case) == observed["resumed_step"], (
            f"the killed run resumed from step {observed['resumed_step']}, you predict {resume_step(*case)}")
    every, per_epoch, fault = RESUME_CASES[0]
    redone = fault - newest_checkpoint_step(every, per_epoch, fault)
    return (f"With a checkpoint every {every} steps and {per_epoch} steps per epoch, a rank lost after step {fault} "
            f"costs {redone} step(s) of work on every rank. --checkpoint-every trades that against the time "
            "spent writing checkpoints.")
