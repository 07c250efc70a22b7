"""One nn.DataParallel step taken apart, with stand-ins that also run on a CPU.

In every forward pass, nn.DataParallel (one process, N GPUs) does four things:
  1. scatter         split the batch along dim 0, one chunk per GPU, copy each chunk there;
  2. replicate       copy the module's parameters and buffers from GPU 0 to every GPU;
  3. parallel_apply  run each replica on its chunk, one Python thread per GPU;
  4. gather          copy the outputs to GPU 0 and concatenate them.
The loss is computed on GPU 0. Backward runs back through the copies, so each
replica's gradients flow into the original parameters on GPU 0 and add up there.

torch.nn.parallel's own scatter, replicate and parallel_apply need CUDA. The
functions here do the same four things on one device, so the notebook can show
each stage and check the result against plain training on the whole batch:

    python scripts/dp_anatomy.py      # one step by hand, and the GIL measurement

``gil_speedups`` times replicas run in threads, the way parallel_apply runs them.
"""
import copy
import threading
import time

import torch
import torch.nn as nn


def scatter(batch, n):
    """Stage 1: the chunks DataParallel gives its GPUs (``tensor.chunk`` along dim 0).

    Chunks have ceil(len / n) samples and the last one is smaller, so a batch too small
    for n GPUs yields fewer than n chunks, and some GPUs get no work at all.
    """
    return list(batch.chunk(n, dim=0))


def replicate(module, n):
    """Stage 2: n replicas whose parameters are differentiable copies of the module's.

    On GPUs the copy is a broadcast from GPU 0 to every GPU, repeated every step. Its
    backward adds the replicas' gradients into the original parameters. ``clone()`` has
    the same forward (a copy) and the same backward (the gradient flows back), on one device.
    """
    replicas = []
    for _ in range(n):
        replica = copy.deepcopy(module)  # the structure and the buffers
        for original, copied in zip(module.modules(), replica.modules()):
            for name, param in original._parameters.items():
                if param is not None:
                    copied._parameters[name] = param.clone()  # not a leaf: grads go back to `param`
        replicas.append(replica)
    return replicas


def parallel_apply(replicas, chunks):
    """Stage 3: each replica on its own chunk, one Python thread each, as DataParallel does."""
    outputs = [None] * len(chunks)
    errors = []

    def work(i):
        try:
            outputs[i] = replicas[i](chunks[i])
        except Exception as error:  # re-raised below, in the calling thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(chunks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return outputs


def gather(outputs):
    """Stage 4: the outputs, back on one device, in batch order."""
    return torch.cat(outputs, dim=0)


def data_parallel_forward(module, batch, n):
    """What ``nn.DataParallel(module)(batch)`` computes over n devices, stage by stage."""
    chunks = scatter(batch, n)
    replicas = replicate(module, len(chunks))
    outputs = parallel_apply(replicas, chunks)
    return gather(outputs)


# --- The GIL: what threads can and cannot run at the same time -------------------------

def python_bound_model():
    """Many tiny layers: the time goes to Python (module calls), which holds the GIL."""
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)]), torch.randn(4, 8)


def compute_bound_model():
    """A few large layers: the time goes to C++ matrix kernels, which release the GIL."""
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]), torch.randn(512, 512)


def time_replicas(model, inputs, replicas, threaded, repeats):
    """Seconds to run ``replicas`` forward passes, one after another or in threads."""
    def work():
        for _ in range(repeats):
            model(inputs)

    with torch.no_grad():
        work()  # warm-up
        started = time.perf_counter()
        if threaded:
            threads = [threading.Thread(target=work) for _ in range(replicas)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for _ in range(replicas):
                work()
        return time.perf_counter() - started


def gil_speedups(replicas=2, repeats=20):
    """Speed-up of running replicas in threads over running them in turn, per workload.

    Each thread gets one intra-op thread, so that any speed-up comes from the threads
    themselves. ``replicas`` cores must be free for the compute-bound case to show it.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        speedups = {}
        for name, build in (("python-bound", python_bound_model), ("compute-bound", compute_bound_model)):
            model, inputs = build()
            one_by_one = time_replicas(model, inputs, replicas, threaded=False, repeats=repeats)
            in_threads = time_replicas(model, inputs, replicas, threaded=True, repeats=repeats)
            speedups[name] = one_by_one / in_threads
        return speedups
    finally:
        torch.set_num_threads(saved)


def main():
    from core.models import Net

    torch.manual_seed(0)
    model, batch = Net(dropout=False), torch.randn(64, 1, 28, 28)
    by_hand = data_parallel_forward(model, batch, n=2)
    difference = (by_hand - model(batch)).abs().max().item()
    print(f"scatter -> chunks of {[len(chunk) for chunk in scatter(batch, 2)]}; "
          f"max |DataParallel by hand - plain forward| = {difference:.1e}")
    for name, speedup in gil_speedups().items():
        print(f"{name}: 2 replicas in threads run {speedup:.2f}x as fast as one after another")


if __name__ == "__main__":
    main()
