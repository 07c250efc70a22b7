"""One nn.DataParallel step taken apart, with stand-ins that also run on a CPU.

In every forward pass, nn.DataParallel (one process, N GPUs) does four things:
  1. scatter         split the batch along dim 0, one chunk per GPU, and copy each chunk there
                     (a chunk already on its GPU stays where it is);
  2. replicate       broadcast the module's parameters and buffers from GPU 0 to every other GPU
                     (NCCL's ring broadcast where NCCL is available);
  3. parallel_apply  run each replica on its chunk, one Python thread per GPU;
  4. gather          copy the outputs to GPU 0 and concatenate them.
The loss is computed on GPU 0. Backward runs back through the copies, so each
replica's gradients flow into the original parameters on GPU 0 and add up there.

torch.nn.parallel's own scatter, replicate and parallel_apply need CUDA. The
functions here do the same four things on one device, so the notebook can show
each stage and check the result against plain training on the whole batch:

    python scripts/demos/dp_anatomy.py      # one step by hand, and the GIL measurement

``gil_speedups`` times replicas run in threads, the way parallel_apply runs them, against
the same replicas in separate processes, which share no GIL.
"""
import copy
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

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
    """(wall seconds, CPU seconds) to run ``replicas`` x ``repeats`` forward passes, in turn or in threads.

    The CPU seconds are summed over the threads that did the work (``time.thread_time``):
    divided by the wall time, they say how many cores were busy at once on average.
    """
    cpu = []

    def work():
        started = time.thread_time()
        for _ in range(repeats):
            model(inputs)
        cpu.append(time.thread_time() - started)

    with torch.no_grad():
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
        return time.perf_counter() - started, sum(cpu)


# Each workload with enough passes to take a few tenths of a second per replica.
WORKLOADS = {"python-bound": (python_bound_model, 100), "compute-bound": (compute_bound_model, 20)}


def intra_op_threads_in_a_new_thread():
    """What ``torch.get_num_threads()`` says inside a thread started after ``set_num_threads``."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def process_worker(rounds, start, done):
    """One of the processes of ``gil_speedups``: its own interpreter, so its own GIL."""
    torch.set_num_threads(1)
    with torch.no_grad():
        for build, repeats in WORKLOADS.values():
            model, inputs = build()
            model(inputs)  # warm-up
            for _ in range(rounds):
                start.wait()  # all processes start together, when the parent says so
                for _ in range(repeats):
                    model(inputs)
                done.wait()  # the round ends when the slowest process does


class ProcessReplicas:
    """``replicas`` spawned processes that run the workloads side by side, one round at a time.

    spawn, never fork: a child forked after MKL ran sgemm in several threads can spin
    forever in MKL's allocator (seen on Linux with the pip wheels), and fork is unsafe on macOS.
    """

    def __init__(self, replicas, rounds):
        context = multiprocessing.get_context("spawn")
        self.start, self.done = context.Barrier(replicas + 1), context.Barrier(replicas + 1)
        self.workers = [context.Process(target=process_worker, args=(rounds, self.start, self.done), daemon=True)
                        for _ in range(replicas)]
        for worker in self.workers:
            worker.start()

    def time_round(self):
        self.start.wait(timeout=300)  # the workers have imported torch and built the model
        started = time.perf_counter()
        self.done.wait(timeout=300)
        return time.perf_counter() - started

    def join(self):
        for worker in self.workers:
            worker.join(timeout=60)


def gil_speedups(replicas=2, rounds=3):
    """Replicas run side by side, in threads (one GIL) and in processes (one GIL each).

    Every thread and process gets one intra-op thread, so that any speed-up comes from
    running the replicas side by side. For each workload:
      threads    speed-up of the threads over running the replicas one after the other;
      processes  the same for separate processes, which share no GIL: near ``replicas`` when
                 that many cores are free, lower when other programs hold them. Not a ceiling
                 for the threads: the one-after-the-other time is taken in this process, so a
                 fresh process that runs each pass faster can take it above ``replicas``;
      busy       cores the threads kept busy, on average (their CPU time / wall time).
    In each round the timings are taken back to back, so that they see the same load from
    other programs; each number is the median over the rounds.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    processes = ProcessReplicas(replicas, rounds)
    try:
        results = {}
        for name, (build, repeats) in WORKLOADS.items():
            model, inputs = build()
            time_replicas(model, inputs, 1, False, 1)  # warm-up
            threads, separate, busy = [], [], []
            for _ in range(rounds):
                one_by_one, _ = time_replicas(model, inputs, replicas, False, repeats)
                wall, cpu = time_replicas(model, inputs, replicas, True, repeats)
                threads.append(one_by_one / wall)
                busy.append(cpu / wall)
                separate.append(one_by_one / processes.time_round())
            results[name] = {"threads": statistics.median(threads), "processes": statistics.median(separate),
                             "busy": statistics.median(busy)}
        return results
    finally:
        processes.join()
        torch.set_num_threads(saved)


def main():
    from lesson.models import Net

    torch.manual_seed(0)
    model, batch = Net(dropout=False), torch.randn(64, 1, 28, 28)
    by_hand = data_parallel_forward(model, batch, n=2)
    difference = (by_hand - model(batch)).abs().max().item()
    print(f"scatter -> chunks of {[len(chunk) for chunk in scatter(batch, 2)]}; "
          f"max |DataParallel by hand - plain forward| = {difference:.1e}")
    for name, speedup in gil_speedups().items():
        print(f"{name}: 2 replicas run {speedup['threads']:.1f}x as fast in 2 threads as one after the other "
              f"(keeping {speedup['busy']:.1f} cores busy), {speedup['processes']:.1f}x in 2 processes")


if __name__ == "__main__":
    main()
