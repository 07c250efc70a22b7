# Solution to notebook 00, exercise 2: predict, then run with three processes.
# Rank r starts all_reduce with (r+1) * [1, 10, 100] and all_gather with [10r, 10r+1].


def predict(world_size):
    summed = [sum(range(1, world_size + 1)) * v for v in (1, 10, 100)]  # (1 + 2 + ... + W) * [1, 10, 100]
    gathered = [[10 * r, 10 * r + 1] for r in range(world_size)]  # every rank's tensor, in rank order
    return {"all_reduce": [summed] * world_size,  # the same sum on every rank
            "all_reduce_mean": [[s / world_size for s in summed]] * world_size,
            "all_gather": [gathered] * world_size}  # everyone holds everything
