# Solution to notebook 09, exercise 1: the rank that waits somewhere else.
# Ranks 0 and 1 wait in all_reduce, called from train_on_my_batches (demos/hangs.py:175);
# rank 2 waits in barrier, called from demo_uneven_then_barrier: the frame just under barrier.
odd_rank = 2
odd_line = 164  # demo_uneven_then_barrier (demos/hangs.py:164) in rank 2's dump
