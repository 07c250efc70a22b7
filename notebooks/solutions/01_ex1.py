# Solution to notebook 01, exercise 1: the test images the model gets wrong, gathered from every rank.
# Each rank scores its evaluation shard (every world_size-th image, no padding, so each image once) and keeps the
# indices in the whole test set; all_gather_object then gives every rank every rank's list, whatever its length.
import torch
import torch.distributed as dist

from lesson import data


def misclassified(model, test_set):
    shard = data.evaluation_shard(test_set, dist.get_rank(), dist.get_world_size())
    wrong = []
    with torch.inference_mode():  # scoring only: no autograd graph
        for index in shard.indices:  # indices in the whole test set
            image, label = test_set[index]
            if model(image.unsqueeze(0)).argmax(dim=1).item() != int(label):
                wrong.append(index)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wrong)  # everyone[r]: rank r's list, on every rank
    return sorted(index for wrong_on_a_rank in everyone for index in wrong_on_a_rank)
