"""step4_ddp.py with one more callback: every rank writes down the learning rate its optimizer uses for
each optimizer step, read from ``optimizer.param_groups`` just before the step, into
``$LEARNING_RATE_LOG/rank<R>.json``. Run with scripts/ on PYTHONPATH, under torchrun or, for a world of one,
with python (lesson/process.py then sets what torchrun would set for one process).
"""
import json
import os
from pathlib import Path

import step4_ddp
from lesson import loop
from machinery import cli, job


class LearningRateLog(loop.Callback):
    def __init__(self, rank):
        self.rank, self.rates = rank, []

    def on_step_start(self, trainer):
        self.rates.append(trainer.optimizer.param_groups[0]["lr"])

    def on_train_end(self, trainer):
        folder = Path(os.environ["LEARNING_RATE_LOG"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self.rank}.json").write_text(json.dumps(self.rates))


def with_learning_rate_log(callbacks):
    def every_callback_and_the_log(script, args, runtime):
        return [*callbacks(script, args, runtime), LearningRateLog(runtime.rank)]
    return every_callback_and_the_log


if __name__ == "__main__":
    job.callbacks = with_learning_rate_log(job.callbacks)  # step4_ddp.py calls job.callbacks(...) by this name
    cli.run(step4_ddp.main, description=step4_ddp.__doc__)
