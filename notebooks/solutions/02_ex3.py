# Solution to notebook 02, exercise 3: when is the mean of the means the mean?
# Each shard's gradient is the mean over its own images; to get the mean over all 64,
# weight each by its number of images.
shard_a, shard_b = gradient(images[:40], labels[:40]), gradient(images[40:], labels[40:])
plain = (shard_a + shard_b) / 2
weighted = (40 * shard_a + 24 * shard_b) / 64
