"""Notebook 04, exercise 3: save a DDP run's model and optimizer on rank 0, then load them on every rank."""
import os
import time

import torch
import torch.distributed as dist

EXERCISE = "04.3"


def load(model, optimizer, path, device):
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def every_rank_saves(ddp_model, optimizer, path):
    torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)  # on each rank
    dist.barrier()


def no_barrier(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)


def save(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
    dist.barrier()


def no_map_location(model, optimizer, path, device):
    state = torch.load(path, weights_only=True)  # each tensor back where it was saved from
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def unsafe_load(model, optimizer, path, device):
    state = torch.load(path, map_location=device, weights_only=False)  # the unpickler may run any code
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def wrapper_state(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.state_dict(), "optimizer": optimizer.state_dict()}, path)  # 'module.' keys
    dist.barrier()


def model_only_save(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save(ddp_model.module.state_dict(), path)
    dist.barrier()


def model_only_load(model, optimizer, path, device):
    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))  # the optimizer starts afresh


def barrier_on_rank_0_only(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
        dist.barrier()  # indented one level too far: rank 1 never calls it


def polls_for_the_file(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
    else:
        while not os.path.exists(path):  # there as soon as torch.save opens it, before its bytes are
            time.sleep(0.001)


def load_on_rank_0(model, optimizer, path, device):
    if dist.get_rank() == 0:  # rank 1 keeps its fresh model and optimizer
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


MISTAKES = [
    ({"save": every_rank_saves, "load": load}, "rank 0 alone should write the file"),
    ({"save": no_barrier, "load": load}, "reached torch.load before rank 0 had written the file"),
    ({"save": save, "load": no_map_location}, "cuda:0 on every rank"),
    ({"save": wrapper_state, "load": load}, "the saved keys start with `module.`"),
    ({"save": model_only_save, "load": model_only_load}, "save the optimizer's state_dict too"),
    ({"save": barrier_on_rank_0_only, "load": load}, "reached torch.load before rank 0 had written the file"),
    ({"save": polls_for_the_file, "load": load}, "rank 1 reached torch.load before rank 0 had written the file"),
    ({"save": save, "load": load_on_rank_0}, "rank 1's model does not hold the trained weights"),
    ({"save": save, "load": unsafe_load}, "weights_only=False"),
]
