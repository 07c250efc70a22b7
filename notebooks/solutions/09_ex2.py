# Solution to notebook 09, exercise 2: whom the others waited for, and whom torchrun blames.
# Every rank that waited wrote "rank 2 last reported step 2 ... (ending the epoch)": rank 2 is the one behind,
# after 2 steps. torchrun's summary names, under "Root Cause (first observed failure)", the first process
# that exited with an error: rank 0, one of those that waited.
culprit = 2
steps_done = 2
root_cause = 0
