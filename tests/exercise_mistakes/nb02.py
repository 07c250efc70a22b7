"""Notebook 02, exercise 3: average the gradients of two uneven shards (40 and 24 images)."""
import torch
import torch.distributed as dist

EXERCISE = "02.3"


def plain_mean(model, images_here):
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()  # right for equal shards only


def no_division(model, images_here):
    for parameter in model.parameters():
        parameter.grad *= images_here
        dist.all_reduce(parameter.grad)  # the weighted sum, never divided


def this_rank_count(model, images_here):
    for parameter in model.parameters():
        parameter.grad *= images_here
        dist.all_reduce(parameter.grad)
        parameter.grad /= images_here  # this rank's images, not all ranks'


def this_rank_count_times_world(model, images_here):
    for parameter in model.parameters():
        parameter.grad *= images_here
        dist.all_reduce(parameter.grad)
        parameter.grad /= images_here * dist.get_world_size()  # the total only if every rank had as many images


def weighted_over_world(model, images_here):
    for parameter in model.parameters():
        parameter.grad *= images_here
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()  # the weighted sum, divided by the ranks instead of the images


def integer_weight(model, images_here):
    images = torch.tensor(images_here)
    dist.all_reduce(images)
    for parameter in model.parameters():
        parameter.grad *= images_here // int(images)  # 40 // 64: 0
        dist.all_reduce(parameter.grad)


def reduced_a_copy(model, images_here):
    for parameter in model.parameters():
        weighted = parameter.grad * images_here  # a new tensor: all_reduce sums it, .grad never sees it
        dist.all_reduce(weighted)


MISTAKES = [
    ({"average_gradients": plain_mean}, "plain mean"),
    ({"average_gradients": no_division}, "divide it by the number of images of all ranks"),
    ({"average_gradients": this_rank_count}, "all_reduce the image count too"),
    ({"average_gradients": this_rank_count_times_world}, "this rank's images times the world size"),
    ({"average_gradients": weighted_over_world}, "weighted sum divided by the world size"),
    ({"average_gradients": integer_weight}, "integer division"),
    ({"average_gradients": reduced_a_copy}, "gradient is unchanged"),
]
