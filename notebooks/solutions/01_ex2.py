# Solution to notebook 01, exercise 2: which world sizes pad the full test set?
# DistributedSampler gives every rank ceil(10,000 / w) samples, so it pads up to the next multiple of w:
# -10_000 % w is how far 10,000 is below that multiple (0 when w divides 10,000).
repeated = {w: -10_000 % w for w in range(1, 9)}
