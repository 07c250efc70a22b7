"""Why the CPU baseline's MFU is what it is: one training step of the Net, profiled by operator.

    python benchmarks/cpu_step_profile.py --threads 2

Runs the baseline's step (the Net, Adam, batch 64, in-memory batches) under torch.profiler and
sums each operator's own CPU time into groups: the convolutions, the linear layers' matrix
products, the element-wise work and pooling of forward and backward, and the optimizer. With the
FLOPs PyTorch counts for the convolutions and the matrix products, each group's achieved GFLOP/s
is set against the measured peak of a large matrix product with the same threads (scripts/kit/mfu.py).
"""
import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repository root, not this folder, goes on sys.path (__init__.py)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from benchmarks import common, report  # noqa: E402
from kit import mfu  # noqa: E402
from lesson import models  # noqa: E402

# Profiler operator names -> group. Anything not listed is element-wise work or pooling.
CONVOLUTION = {"aten::mkldnn_convolution", "aten::convolution_backward", "aten::_convolution"}
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm"}
# The FLOP counter's operator names for the same two groups.
FLOP_GROUPS = {"convolution": ("convolution", "convolution_backward"), "matmul": ("mm", "addmm", "bmm")}


def make_step(batch_size):
    torch.manual_seed(0)
    model = models.Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    images, labels = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.nll_loss(model(images), labels).backward()
        optimizer.step()

    return model, images, labels, step


def flops_per_step(model, images, labels):
    """Matrix-product and convolution FLOPs of forward + backward, by group."""
    counter = FlopCounterMode(display=False)
    with torch.random.fork_rng(devices=[]), counter:
        F.nll_loss(model(images), labels).backward()
    by_op = counter.get_flop_counts()["Global"]
    return {group: sum(n for op, n in by_op.items() if str(op).split(".")[-1] in names)
            for group, names in FLOP_GROUPS.items()}


def profile_steps(step, steps):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    groups = {"convolution": 0.0, "matmul": 0.0, "optimizer": 0.0, "elementwise and pooling": 0.0}
    for event in prof.key_averages():
        if event.key.startswith("Optimizer.step"):
            groups["optimizer"] += event.cpu_time_total  # total: the update's own operators sit inside it
        elif event.key in CONVOLUTION:
            groups["convolution"] += event.self_cpu_time_total
        elif event.key in MATMUL:
            groups["matmul"] += event.self_cpu_time_total
    total = sum(e.self_cpu_time_total for e in prof.key_averages() if not e.key.startswith("ProfilerStep"))
    groups["elementwise and pooling"] = total - groups["convolution"] - groups["matmul"] - groups["optimizer"]
    return {group: microseconds / 1e6 / steps for group, microseconds in groups.items()}  # seconds per step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=common.usable_cores())
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--records", type=Path, default=common.DEFAULT_RECORDS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = common.load_average()
    model, images, labels, step = make_step(args.batch_size)
    flops = flops_per_step(model, images, labels)
    for _ in range(10):  # warm-up: oneDNN picks its kernels, the allocator fills its caches
        step()
    seconds = profile_steps(step, args.steps)
    peak = mfu.measure_cpu_peak()
    record = {"benchmark": "cpu_step_profile", "hardware": common.hardware(), "threads": args.threads,
              "batch_size": args.batch_size, "steps": args.steps, "peak_flops": peak,
              "load_average": [load_before, common.load_average()], "seconds_per_step": seconds,
              "flops_per_step": flops}
    print(report.render(record))
    common.write_record(args.records, "cpu_step_profile", record)


if __name__ == "__main__":
    main()
