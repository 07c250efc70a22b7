# Solution to notebook 04, exercise 3: steps per epoch on N GPUs.
# DistributedSampler gives every rank ceil(images / gpus) indices; they are cut into batches,
# and the last, shorter batch is a step too.
import math


def steps_per_epoch(gpus, batch_size, images=60_000):
    return math.ceil(math.ceil(images / gpus) / batch_size)
