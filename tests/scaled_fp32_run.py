"""step1_baseline.py with its GradScaler switched on for fp32 on a CPU, growing every step.

fp16, the only precision that enables the scaler, needs a GPU; this run lets a CPU test see
the checkpoint path carry a real, changing scaler state. The scaler is PyTorch's own
``torch.amp.GradScaler("cpu")``; only its settings differ: the scale starts at 2**10 and
doubles after every step without inf/NaN gradients (growth_interval=1), so the scale
tells how many steps it has seen. Run with scripts/ on PYTHONPATH.
"""
import torch

import step1_baseline
from kit import precision
from lesson import loop
from machinery import cli

INITIAL_SCALE = 2.0 ** 10


class GrowingScalerFP32(precision.Precision):
    def __init__(self, name, device):
        super().__init__(name, device)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=INITIAL_SCALE, growth_interval=1)


if __name__ == "__main__":
    loop.Precision = GrowingScalerFP32  # the Trainer builds its Precision from this name in lesson/loop.py
    cli.run(step1_baseline.main, description=step1_baseline.__doc__)
