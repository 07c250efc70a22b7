# Solution to notebook 02, exercise 2: a different seed on each rank.
# Each rank shuffles with its own seed, so the two halves are drawn independently.
from torch.utils.data.distributed import DistributedSampler

rank0 = set(DistributedSampler(train_set, num_replicas=2, rank=0, seed=0))
rank1 = set(DistributedSampler(train_set, num_replicas=2, rank=1, seed=1))
overlap = len(rank0 & rank1)  # about half of rank 1's 2,000 images are also rank 0's ...
never_seen = len(train_set) - len(rank0 | rank1)  # ... and as many are on neither rank
