# Solution to notebook 08, exercise 1: bus bandwidth.
# A ring all_reduce is a reduce-scatter then an all-gather; in each, a rank sends n-1 chunks of
# 1/n of the message. So each rank's link carries 2(n-1)/n of the message: busbw = algbw x 2(n-1)/n.


def bus_bandwidth(algbw, ranks):
    return algbw * 2 * (ranks - 1) / ranks
