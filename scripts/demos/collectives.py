"""Step 0: the collectives that data parallelism is built from, live.

    torchrun --nproc-per-node=2 scripts/demos/collectives.py
    torchrun --nproc-per-node=2 scripts/demos/collectives.py --device cpu --backend gloo
    torchrun --nproc-per-node=2 scripts/demos/collectives.py --time-averaging
    torchrun --nproc-per-node=2 scripts/demos/collectives.py --late-rank 1

Every rank starts with different numbers and calls the same collective; the
output shows what each rank held before and after:

  all_reduce   every rank ends with the element-wise sum over all ranks
               (then divided by the world size: the mean, which is how
               gradients are averaged in step 2);
  broadcast    every rank ends with rank 0's tensor (how every replica
               starts from the same weights);
  all_gather   every rank ends with the tensors of all ranks, in rank order.

Each rank sends its before/after values to rank 0 (with all_gather_object,
itself a collective), and rank 0 alone prints them, in rank order. If every
rank printed its own lines, they would interleave in a different order on
every run.

--time-averaging times the two gradient-averaging functions of step 2
(scripts/step2_allreduce.py), one all_reduce per parameter tensor against one
all_reduce of a flat bucket, on the Net's 8 gradient tensors and on a model of
the same size cut into 160 tensors (as many as ResNet-50 has). Every call pays
a fixed latency, so many small messages cost more than one large one.

--late-rank S makes rank 1 call all_reduce S seconds after rank 0, and rank 0 reports
when its call returned and when the sum reached the host. With gloo the call itself
waits for the late rank. With NCCL the call only queues the operation on the GPU and
returns at once; the host waits later, where it needs the result (here .item()).
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the course's packages and steps

import torch
import torch.distributed as dist
from torch import nn

from demos import runner
from kit import agreement
from lesson import models, process
from machinery import cli
from step2_allreduce import average_gradients_bucket, average_gradients_per_parameter


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda:LOCAL_RANK when a GPU is present, else cpu")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="auto: nccl with CUDA, gloo on CPU")
    parser.add_argument("--timeout", type=cli.positive_int, default=60, help="seconds a collective may wait")
    parser.add_argument("--threads", type=cli.positive_int, default=1, help="CPU threads per process (default: 1)")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 also writes what every rank held here")
    parser.add_argument("--time-averaging", action="store_true",
                        help="instead of the demo, time per-parameter against bucketed gradient averaging")
    parser.add_argument("--repeats", type=cli.positive_int, default=20, help="timed calls per averaging function")
    parser.add_argument("--late-rank", type=cli.positive_float, default=None, metavar="S",
                        help="instead of the demo, rank 1 joins an all_reduce S seconds late: where does rank 0 wait?")
    parser.set_defaults(seed=0)
    return parser.parse_args(argv)


def all_reduce_sum(rank, device):
    tensor = torch.tensor([1.0, 10.0, 100.0], device=device) * (rank + 1)
    before = tensor.tolist()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # in place, on every rank
    return before, tensor.tolist()


def all_reduce_mean(rank, device):
    tensor = torch.tensor([1.0, 10.0, 100.0], device=device) * (rank + 1)
    before = tensor.tolist()
    # SUM, then divide: works on every backend (ReduceOp.AVG does not exist on all of them)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor /= dist.get_world_size()
    return before, tensor.tolist()


def broadcast_from_rank0(rank, device):
    # Each rank draws its own "initial weights" from its own seed ...
    tensor = torch.randn(3, generator=torch.Generator().manual_seed(rank)).to(device)
    before = tensor.tolist()
    dist.broadcast(tensor, src=0)  # ... and then every rank holds rank 0's
    return before, tensor.tolist()


def all_gather(rank, device):
    tensor = torch.tensor([0.0, 1.0], device=device) + 10 * rank
    before = tensor.tolist()
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)  # gathered[r] is rank r's tensor, on every rank
    return before, [t.tolist() for t in gathered]


DEMOS = [
    ("all_reduce", all_reduce_sum, "all_reduce(SUM): every rank ends with the element-wise sum"),
    ("all_reduce_mean", all_reduce_mean,
     "all_reduce(SUM), then divide by the world size: the mean (how step 2 averages gradients)"),
    ("broadcast", broadcast_from_rank0, "broadcast(src=0): every rank ends with rank 0's tensor"),
    ("all_gather", all_gather, "all_gather: every rank ends with every rank's tensor, in rank order"),
]


def number(value):
    """1.0 -> '1', 1.5 -> '1.5', 0.123456 -> '0.1235': short, and the same on every run."""
    return f"{value:.4f}".rstrip("0").rstrip(".")


def show(values):
    if isinstance(values[0], list):
        return "[" + ", ".join(show(v) for v in values) + "]"
    return "[" + ", ".join(number(v) for v in values) + "]"


def report(identities, results):
    lines = ["who is who"]
    for rank, who in enumerate(identities):
        lines.append(f"  rank {rank}: local rank {who['local_rank']}, world size {who['world_size']}, "
                     f"local world size {who['local_world_size']}, device {who['device']}, backend {who['backend']}")
    for name, _, title in DEMOS:
        before_width = max(len(show(before)) for before, _ in results[name])
        lines += ["", title]
        for rank, (before, after) in enumerate(results[name]):
            lines.append(f"  rank {rank}  before {show(before):<{before_width}}  after {show(after)}")
    return "\n".join(lines)


def many_tensor_model(tensors=160, width=122):
    """Linear layers with as many parameter tensors as ResNet-50 (161), about the Net's size in floats."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(tensors // 2)])


def time_averaging(device, repeats):
    """Milliseconds per call of each averaging function, for two models: {model: {mode: ms}}."""
    timings = {}
    for name, model in [("Net", models.Net()), ("160 tensors", many_tensor_model())]:
        model = model.to(device)
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        row = {"tensors": len(list(model.parameters())), "floats": sum(p.numel() for p in model.parameters())}
        for mode, average in [("per-parameter", average_gradients_per_parameter),
                              ("bucket", average_gradients_bucket)]:
            for _ in range(3):  # warm-up: the first calls set up connections and buffers
                average(model)
            synchronize(device)
            started = time.perf_counter()
            for _ in range(repeats):
                average(model)
            synchronize(device)
            # the slowest rank
            row[mode] = max(agreement.gather_from_all_ranks((time.perf_counter() - started) / repeats * 1e3))
        timings[name] = row
    return timings


def synchronize(device):
    """Wait for every rank (and, on a GPU, for the queued kernels) before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def time_a_late_rank(rank, device, delay):
    """Rank 1 reaches an all_reduce ``delay`` seconds after the others. Where does rank 0 wait?

    Returns rank 0's seconds from its call to the call's return, and to the sum being on the host.
    """
    dist.all_reduce(torch.ones(1, device=device))  # warm-up: NCCL sets up its communicator at the first collective
    synchronize(device)  # everyone starts the clock together
    tensor = torch.ones(1, device=device)
    if rank == 1:
        time.sleep(delay)
    started = time.perf_counter()
    dist.all_reduce(tensor)
    returned = time.perf_counter() - started
    tensor.item()  # the host needs the value: on a GPU this waits for the all_reduce to finish
    on_host = time.perf_counter() - started
    return {"delay": delay, "call_returned": returned, "sum_on_host": on_host, "sum": tensor.item()}


def report_late_rank(timing, backend):
    return "\n".join([
        f"rank 1 calls all_reduce {timing['delay']:g} s after rank 0; on rank 0, backend {backend}:",
        f"  dist.all_reduce(t) returned after {timing['call_returned']:.2f} s",
        f"  t.item() had the sum ({timing['sum']:g}) after {timing['sum_on_host']:.2f} s",
    ])


def report_timings(timings, world_size, backend):
    lines = [f"gradient averaging across {world_size} rank(s), backend {backend}: milliseconds per call",
             f"{'model':<13}{'tensors':>8}{'floats':>11}{'per-parameter':>15}{'bucket':>9}{'ratio':>8}"]
    for name, row in timings.items():
        lines.append(f"{name:<13}{row['tensors']:>8}{row['floats']:>11,}{row['per-parameter']:>12.2f} ms"
                     f"{row['bucket']:>6.2f} ms{row['per-parameter'] / row['bucket']:>7.1f}x")
    return "\n".join(lines)


def write_json(path, record):
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")


def main(args):
    runtime = runner.setup(args)  # the training scripts' set-up, pre-flight included
    rank, local_rank, world_size, local_world_size = process.process_layout()
    device = runtime.device

    if args.late_rank:
        timing = time_a_late_rank(rank, device, args.late_rank)
        if rank == 0:
            print(report_late_rank(timing, runtime.backend), flush=True)
            write_json(args.json, {"world_size": world_size, "backend": runtime.backend, **timing})
        return runner.leave_together()

    if args.time_averaging:
        timings = time_averaging(device, args.repeats)
        if rank == 0:
            print(report_timings(timings, world_size, runtime.backend), flush=True)
            write_json(args.json, {"world_size": world_size, "timings_ms": timings})
        return runner.leave_together()

    identity = {"local_rank": local_rank, "world_size": dist.get_world_size(),
                "local_world_size": local_world_size, "device": str(device), "backend": dist.get_backend()}
    identities = agreement.gather_from_all_ranks(identity)
    results = {name: agreement.gather_from_all_ranks(demo(rank, device)) for name, demo, _ in DEMOS}

    if rank == 0:
        print(report(identities, results), flush=True)
        write_json(args.json, {"world_size": world_size, "ranks": identities,
                               **{name: {"before": [b for b, _ in per_rank], "after": [a for _, a in per_rank]}
                                  for name, per_rank in results.items()}})
    runner.leave_together()


if __name__ == "__main__":
    cli.run(main, parse=parse_args)
