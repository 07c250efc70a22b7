# Solution to notebook 03, exercise 3: DataParallel's route, written with processes.
# Sum the gradients on rank 0, make them the mean over both halves, step there alone,
# then send rank 0's weights to every rank.
import torch.distributed as dist


def step_through_rank0(model, optimizer):
    for parameter in model.parameters():
        dist.reduce(parameter.grad, dst=0)  # SUM into rank 0's .grad; gloo leaves scratch values in the others'
    if dist.get_rank() == 0:
        for parameter in model.parameters():
            parameter.grad /= dist.get_world_size()  # each rank's gradient is the mean over its own half
        optimizer.step()
    for parameter in model.parameters():
        dist.broadcast(parameter, src=0)  # rank 0's updated weights, to every rank
