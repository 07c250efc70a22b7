# Solution to notebook 04, exercise 2: predict the buckets.
# Walk the parameters in the order their gradients arrive; close a bucket as soon as it reaches its cap.
# The first bucket has its own (smaller) cap; every later one uses the last cap in the list.


def predict_buckets(numels, caps_bytes):
    buckets, current, cap_index = [], 0, 0
    for numel in numels:
        current += numel
        if current * 4 >= caps_bytes[cap_index]:  # float32: 4 bytes per value
            buckets.append(current)
            current, cap_index = 0, min(cap_index + 1, len(caps_bytes) - 1)
    return buckets + ([current] if current else [])
