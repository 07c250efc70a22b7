"""The checks of 07_beyond_ddp.ipynb's exercises: DDP's synchronisations with and without no_sync, and ZeRO-1's
optimizer state per rank, against what the demos measured. Notebook support: a learner may skip this module.
"""
from .registry import exercise


@exercise(1, answers=("syncs_per_step",))
def check_syncs_per_step(syncs_per_step, observed):
    k = observed["micro_batches"]
    for way, use_no_sync in (("no_sync", True), ("without no_sync", False)):
        seen = observed[way]["syncs_per_step"][-1]
        got = syncs_per_step(k, use_no_sync)
        assert got == seen, f"syncs_per_step({k}, use_no_sync={use_no_sync}) = {got}; DDP synchronised {seen} time(s)"
    for micro_batches in (1, 2, 8, 32):  # the rule, beyond the K the demo ran
        pair = (syncs_per_step(micro_batches, True), syncs_per_step(micro_batches, False))
        assert pair == (1, micro_batches), (f"for {micro_batches} micro-batches you predict {pair} (with, without "
                                            "no_sync): think about what happens in each backward")
    return (f"With no_sync one sync per optimizer step, whatever K; without it one per micro-batch: {k} times the "
            "traffic, for exactly the same weights. On a slow network that is the difference between "
            "accumulation being nearly free and costing K steps' worth of communication.")


ADAM_BYTES_PER_NUMBER = 8  # exp_avg and exp_avg_sq, float32 each


@exercise(2, answers=("zero_state_per_rank",))
def check_zero_state_per_rank(zero_state_per_rank, observed, parameter_numels):
    ranks = observed["ranks"]
    predicted = list(zero_state_per_rank(list(parameter_numels), len(ranks)))
    measured = [rank["zero"] for rank in ranks]
    assert len(predicted) == len(ranks), f"one number per rank, please: got {len(predicted)} for {len(ranks)} ranks"
    assert sum(predicted) == ranks[0]["adam"], (f"your ranks hold {sum(predicted):,} bytes together; Adam's whole "
                                                f"state is {ranks[0]['adam']:,}: every parameter's state lives on "
                                                "exactly one rank")
    assert predicted == measured, (f"you predict {predicted} bytes per rank; ZeroRedundancyOptimizer measured "
                                   f"{measured}. It hands out whole parameters, not equal slices")
    return (f"{measured}: ZeroRedundancyOptimizer gives whole parameters, largest first, to the rank holding the "
            "least so far. One 1.2M-number layer (fc1.weight) outweighs the rest of the Net, so one rank keeps "
            "almost everything: ZeRO-1 saves memory on models of many similar layers (transformers), not on "
            "this one. FSDP shards every parameter itself, so its shares are even.")
