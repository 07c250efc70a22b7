"""``--precision``: autocast for the forward pass and the loss; for fp16, a gradient scaler.
Kit: a learner may skip this module (notebook 07 teaches it).

bf16 keeps fp32's exponent range, so its gradients need no scaling; fp16's small
gradients underflow to zero unless the loss is scaled up first (GradScaler).
"""
import contextlib

import torch

from .errors import CourseError


class Precision:
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
