# Solution to notebook 07, exercise 2: Adam's state per rank under ZeRO-1.
# ZeroRedundancyOptimizer sorts the parameters by size, largest first, and gives each to the rank
# that holds the fewest numbers so far (the lowest rank on a tie). Adam keeps two float32 numbers
# (exp_avg, exp_avg_sq) per parameter number: 8 bytes.


def zero_state_per_rank(parameter_numels, world_size):
    held = [0] * world_size
    for numel in sorted(parameter_numels, reverse=True):
        lightest = held.index(min(held))
        held[lightest] += numel
    return [8 * numbers for numbers in held]
