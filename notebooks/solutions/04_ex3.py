# Solution to notebook 04, exercise 3: save and load on every rank.
# Every rank holds the same weights and optimizer state, so rank 0 alone writes them (the plain model's, without
# `module.`); the barrier keeps every rank in `save` until the file is there. Each rank then maps the tensors onto
# its own device.
import torch
import torch.distributed as dist


def save(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
    dist.barrier()  # every rank calls it: nobody leaves before the file is written


def load(model, optimizer, path, device):
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
