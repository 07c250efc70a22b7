# Solution to notebook 03, exercise 1: who gets what.
# Scatter cuts with Tensor.chunk: pieces of ceil(len / n) samples, the last one gets what is left,
# and a batch too small for n pieces gives fewer pieces (so some GPUs get nothing).
import torch

sizes_100_on_3 = [len(chunk) for chunk in torch.arange(100).chunk(3)]  # ceil(100 / 3) = 34: [34, 34, 32]
gpus_working_2_on_4 = len(torch.arange(2).chunk(4))  # pieces of ceil(2 / 4) = 1: two pieces
