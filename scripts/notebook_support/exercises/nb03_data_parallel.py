"""The checks of 03_data_parallel.ipynb's exercises: how DataParallel's scatter cuts a batch, and the weights its
replicate copies every step. Notebook support: a learner may skip this module.
"""
import math

import torch

from .registry import exercise


@exercise(1, answers=("sizes_100_on_3", "gpus_working_2_on_4"))
def check_scatter(sizes_100_on_3, gpus_working_2_on_4):
    # DataParallel's scatter cuts the batch with Tensor.chunk (torch/csrc/cuda/comm.cpp, scatter()).
    expected = [len(chunk) for chunk in torch.arange(100).chunk(3)]
    assert list(sizes_100_on_3) == expected, f"{list(sizes_100_on_3)} is not how chunk() cuts 100 samples in 3"
    working = len(torch.arange(2).chunk(4))
    assert gpus_working_2_on_4 == working, f"{gpus_working_2_on_4} GPUs is not how many get a piece of 2 samples"
    return (f"100 samples on 3 GPUs: {expected} (chunk() makes pieces of ceil(100 / 3) = 34 and the last gets "
            f"what is left); 2 samples on 4 GPUs: {working} GPUs work, {4 - working} wait.")


@exercise(2, answers=("per_step", "per_epoch"))
def check_replicate_traffic(per_step, per_epoch, gpus=4, images=60_000, batch_per_gpu=64):
    from lesson.models import Net

    model_bytes = sum(p.numel() * p.element_size() for p in Net().parameters())
    steps = math.ceil(images / (batch_per_gpu * gpus))
    assert per_step == model_bytes * (gpus - 1), (
        f"per_step = {per_step:,} bytes: count one float32 copy of the Net for every GPU that needs one")
    assert per_epoch == per_step * steps, f"per_epoch = {per_epoch:,}: how many steps does one epoch take?"
    return (f"{per_step / 1e6:.1f} MB of weights reach GPUs 1-{gpus - 1} every step, {per_epoch / 1e9:.2f} GB "
            f"per epoch of {steps} steps. With NCCL's ring broadcast, GPU 0 itself sends about one copy "
            f"({model_bytes / 1e6:.1f} MB) to its neighbour, which keeps it and passes it on: every link carries "
            "about one copy per step. In backward, the replicas' gradients are summed onto GPU 0, along a ring "
            "too. In DDP the weights never move: each process sends about 2 x (N - 1) / N copies of the "
            "gradients per step, all processes at once, and mostly while backward is still running (notebook 04).")
