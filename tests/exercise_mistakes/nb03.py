"""Notebook 03, exercise 3: DataParallel's route in 2 processes (gradients summed on rank 0, one step there, the
weights broadcast back)."""
import torch.distributed as dist

EXERCISE = "03.3"


def reduce_and_step(model, optimizer):
    for parameter in model.parameters():
        dist.reduce(parameter.grad, dst=0)
        if dist.get_rank() == 0:
            parameter.grad /= dist.get_world_size()
    if dist.get_rank() == 0:
        optimizer.step()


def no_broadcast(model, optimizer):
    reduce_and_step(model, optimizer)  # rank 1 never hears of the new weights


def broadcast_before_step(model, optimizer):
    for parameter in model.parameters():
        dist.reduce(parameter.grad, dst=0)
        parameter.grad /= dist.get_world_size()
    for parameter in model.parameters():
        dist.broadcast(parameter, src=0)  # rank 0's weights before its step
    if dist.get_rank() == 0:
        optimizer.step()


def no_division(model, optimizer):
    for parameter in model.parameters():
        dist.reduce(parameter.grad, dst=0)  # the sum of two half-batch means, never divided
    if dist.get_rank() == 0:
        optimizer.step()
    for parameter in model.parameters():
        dist.broadcast(parameter, src=0)


def every_rank_steps_alone(model, optimizer):
    optimizer.step()  # each rank with its own half's gradient, no reduce


def the_ddp_way(model, optimizer):
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()
    optimizer.step()  # right weights on every rank, but every rank updates: not DataParallel's route


def broadcast_on_rank0_only(model, optimizer):
    reduce_and_step(model, optimizer)
    if dist.get_rank() == 0:
        for parameter in model.parameters():
            dist.broadcast(parameter, src=0)  # rank 1 never calls it: it returns with its old weights


MISTAKES = [
    ({"step_through_rank0": no_broadcast}, "keeps its old weights"),
    ({"step_through_rank0": broadcast_before_step}, "after rank 0's optimizer.step()"),
    ({"step_through_rank0": no_division}, "divide the summed gradients by the world size"),
    ({"step_through_rank0": every_rank_steps_alone}, "rank 0 alone updates and sends the weights"),
    ({"step_through_rank0": the_ddp_way}, "rank 0 alone updates and sends the weights"),
    # Last: rank 0 is left in broadcasts that rank 1 never joins; they fail when rank 1's process ends.
    ({"step_through_rank0": broadcast_on_rank0_only}, "keeps its old weights"),
]
