# Solution to notebook 00, exercise 1: where does rank 6 run?
# torchrun numbers the processes node by node: the node with group rank n holds ranks n*P ... n*P+P-1,
# with local ranks 0 ... P-1 (P processes per node), and the GPU is cuda:LOCAL_RANK.


def where(rank, gpus_per_node):
    node, local_rank = divmod(rank, gpus_per_node)
    return node, local_rank, f"cuda:{local_rank}"


# 3 nodes x 4 GPUs: every node has cuda:0 ... cuda:3 only, so cuda:{rank} fails for ranks 4 and up.
crash_with_global_rank = [rank for rank in range(3 * 4) if rank >= 4]
