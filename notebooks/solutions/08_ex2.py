# Solution to notebook 08, exercise 2: the share of a step spent communicating, without overlap.
# Compute: the batch's FLOPs at the achieved rate. Communication: every step all-reduces the whole
# gradient, whatever the batch; each rank's link carries 2(n-1)/n of it, at the bus bandwidth.


def communication_share(batch, flops_per_sample, flops_per_second, gradient_bytes, busbw, ranks):
    compute_seconds = batch * flops_per_sample / flops_per_second
    communication_seconds = gradient_bytes * 2 * (ranks - 1) / ranks / busbw
    return communication_seconds / (compute_seconds + communication_seconds)
