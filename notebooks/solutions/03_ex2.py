# Solution to notebook 03, exercise 2: what replicate costs.
import math

from lesson import models

model_bytes = sum(p.numel() * 4 for p in models.Net().parameters())  # float32: 4 bytes per parameter
per_step = model_bytes * (4 - 1)  # a full copy for each of GPUs 1, 2 and 3, every step
per_epoch = per_step * math.ceil(60_000 / (64 * 4))  # 256 images per step: 235 steps, the last one short
