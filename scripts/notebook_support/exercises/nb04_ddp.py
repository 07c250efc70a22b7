"""The checks of 04_ddp.ipynb's exercises: a checkpoint saved with DDP's prefix loaded into the plain Net, DDP's buckets
against those it built, and the steps each rank takes per epoch. Notebook support: a learner may skip this module.
"""
import math

import torch
from torch.utils.data.distributed import DistributedSampler

from .registry import exercise


@exercise(1, answers=("rescued",))
def check_rescued(rescued, checkpoint):
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert all(key.startswith("module.") for key in saved), "the file itself should stay as it was saved"
    assert isinstance(rescued, torch.nn.Module), "rescued should be the plain Net, with the weights loaded"
    state = rescued.state_dict()
    assert sorted(f"module.{key}" for key in state) == sorted(saved), "rescued has other parameters than the file"
    for key, value in state.items():
        assert torch.equal(value.cpu(), saved[f"module.{key}"]), f"rescued's {key} is not the one in the file"
    return ("The plain Net holds every tensor of the file. Strip the prefix when loading "
            "(consume_prefix_in_state_dict_if_present), and save model.module.state_dict() from now on.")


BACKWARD_ORDER = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight",
                  "conv2.weight", "conv2.bias", "conv1.weight", "conv1.bias"]


@exercise(2, answers=("predict_buckets",))
def check_predict_buckets(predict_buckets, observed):
    numels = [observed["parameter_numels"][name] for name in BACKWARD_ORDER]
    mib = 2**20
    default = list(predict_buckets(numels, [1 * mib, 25 * mib]))
    explicit = list(predict_buckets(numels, [25 * mib]))
    assert default == observed["bucket_numels"][1], (
        f"with the default caps you predict {default}; DDP built {observed['bucket_numels'][1]}")
    assert explicit == observed["explicit_cap_25_numels"], (
        f"with bucket_cap_mb=25 you predict {explicit}; DDP built {observed['explicit_cap_25_numels']}")
    return (f"Defaults: {default}, as DDP built them. With bucket_cap_mb=25 the whole Net (4.8 MB) fits in the "
            f"first bucket, {explicit}: one all_reduce that waits for the whole backward, so nothing overlaps. "
            "Small buckets pay many latencies, large ones start late; for this model, the small first bucket "
            "of the default is what creates the overlap.")


@exercise(3, answers=("steps_per_epoch",))
def check_steps_per_epoch(steps_per_epoch, images=60_000, global_batch=64):
    lines = []
    for gpus in (1, 2, 4, 8):
        for batch in (global_batch // gpus, global_batch):
            shard = len(DistributedSampler(range(images), num_replicas=gpus, rank=0))
            expected = math.ceil(shard / batch)  # the last, shorter batch is a step too
            got = steps_per_epoch(gpus, batch, images)
            assert got == expected, f"steps_per_epoch({gpus}, {batch}, {images}) = {got}: not what each rank does"
        lines.append(f"{gpus} GPU(s): {steps_per_epoch(gpus, global_batch // gpus, images)} steps of "
                     f"{global_batch // gpus}, or {steps_per_epoch(gpus, global_batch, images)} of {global_batch}")
    return ("Per rank and epoch: " + "; ".join(lines) + ". With a fixed global batch every rank takes as many "
            "steps as one GPU did, each on fewer images.")
