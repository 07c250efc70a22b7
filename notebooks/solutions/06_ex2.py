# Solution to notebook 06, exercise 2: the GPUs of a model-parallel replica, by global rank.
# torchrun numbers the processes of the node with group rank 0 first, then group rank 1's, ...; each node numbers
# its GPUs from 0, so the GPUs come from the local rank, never the global one: 2 x LOCAL_RANK and 2 x LOCAL_RANK + 1.


def replica_gpus(rank, gpus_per_node, processes_per_node):
    node, local_rank = divmod(rank, processes_per_node)
    return node, 2 * local_rank, 2 * local_rank + 1
