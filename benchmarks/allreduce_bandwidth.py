"""all_reduce micro-benchmark: time, algorithm bandwidth and bus bandwidth from 1 KiB to 256 MiB.

    python benchmarks/allreduce_bandwidth.py                 # every GPU (NCCL), or 2 CPU processes (gloo)
    python benchmarks/allreduce_bandwidth.py --nproc 4 --max-bytes 64M

Starts itself under torchrun when it was not started by it. The numbers follow nccl-tests
(doc/PERFORMANCE.md in NVIDIA/nccl-tests):
  time    the mean of back-to-back all_reduces of one message (slowest rank);
  algbw   size / time;
  busbw   algbw x 2(n-1)/n for n ranks: what each rank's link carries, comparable across n.
Then the course's own gradient all_reduce (the Net's gradients, as step2_allreduce.py averages
them) is timed the same way, to compare with the sweep at the same message size.
"""
import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repository root, not this folder, goes on sys.path (__init__.py)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks import common  # noqa: E402, I001 (first: it puts scripts/ on sys.path for step2_allreduce)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Imported before the process group starts, as every course script does: they import
# kit/launch_checks.py, which imports torch.distributed.nn first (imported after init_process_group,
# it keeps the gloo group alive to the end of the process; launch_checks.py says why). Its worker threads
# then outlive the script and can free a tensor while Python shuts down, which aborts the process
# (SIGABRT, "terminate called without an active exception").
import step2_allreduce  # noqa: E402
from lesson import models  # noqa: E402

INPUT_SHAPES = {"net": (1, 28, 28), "resnet18": (3, 32, 32)}  # one sample of each model's data


def message_sizes(smallest, largest, factor):
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= factor
    return sizes


def iterations_for(size, budget_bytes, least=5, most=200):
    """The same on every rank (a collective count must match): enough repeats to average out noise."""
    return max(least, min(most, math.ceil(budget_bytes / size)))


def bus_bandwidth(algbw, world_size):
    """nccl-tests' correction for all_reduce: each rank sends and receives 2(n-1)/n of the message."""
    return algbw * 2 * (world_size - 1) / world_size


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest_rank(seconds, device):
    """The time of the slowest rank: a collective has finished only when every rank has."""
    value = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def time_collective(run_once, iterations, device, warmup=2):
    for _ in range(warmup):
        run_once()
    synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        run_once()
    synchronize(device)
    return slowest_rank((time.perf_counter() - started) / iterations, device)


def sweep(sizes, device, budget_bytes):
    world_size = dist.get_world_size()
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        seconds = time_collective(lambda: dist.all_reduce(tensor), iterations_for(size, budget_bytes), device)
        algbw = size / seconds
        rows.append({"bytes": size, "seconds": seconds, "algbw_gbps": algbw / 1e9,
                     "busbw_gbps": bus_bandwidth(algbw, world_size) / 1e9})
    return rows


def gradient_allreduce(device, model_name, iterations):
    """Time step2_allreduce.py's two after-backward averages on the model's real gradients."""
    torch.manual_seed(0)  # the model alone, with no data set or flags: only its gradients' sizes are timed
    model = models.MODELS[model_name](dropout=False, num_classes=10).to(device)
    sample = torch.randn(2, *INPUT_SHAPES[model_name], device=device)
    model(sample).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    size = sum(g.numel() * g.element_size() for g in grads)
    world_size = dist.get_world_size()
    result = {"model": model_name, "bytes": size, "tensors": len(grads)}
    for mode in ("bucket", "per-parameter"):
        average = step2_allreduce.AVERAGE_GRADIENTS[mode]
        seconds = time_collective(lambda: average(model), iterations, device)
        result[mode] = {"seconds": seconds, "algbw_gbps": size / seconds / 1e9,
                        "busbw_gbps": bus_bandwidth(size / seconds, world_size) / 1e9}
    return result


def nearest_row(rows, size):
    return min(rows, key=lambda row: abs(math.log(row["bytes"] / size)))


def print_table(rows, world_size, backend):
    print(f"\nall_reduce, {world_size} ranks, {backend}, float32, sum (time: mean of back-to-back calls, slowest rank)")
    print(f"{'size':>10}{'time':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for row in rows:
        print(f"{common.format_size(row['bytes']):>10}{row['seconds'] * 1e6:>10.1f} us"
              f"{row['algbw_gbps']:>12.3f}{row['busbw_gbps']:>12.3f}")


def print_gradient_comparison(gradients, rows):
    reference = nearest_row(rows, gradients["bytes"])
    bucket, per_parameter = gradients["bucket"], gradients["per-parameter"]
    print(f"\nthe course's gradient all_reduce ({gradients['model']}, {gradients['tensors']} tensors, "
          f"{gradients['bytes'] / 2**20:.1f} MiB): one bucket {bucket['busbw_gbps']:.2f} GB/s busbw "
          f"({bucket['seconds'] * 1e3:.2f} ms), per parameter {per_parameter['busbw_gbps']:.2f} GB/s "
          f"({per_parameter['seconds'] * 1e3:.2f} ms); the sweep at {common.format_size(reference['bytes'])}: "
          f"{reference['busbw_gbps']:.2f} GB/s")


def setup(device_choice="auto"):
    """The usual rules: cuda:LOCAL_RANK with NCCL where there are GPUs (unless --device cpu), else the
    CPU with gloo."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and device_choice != "cpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    dist.init_process_group(backend)
    return device, backend


def relaunch_under_torchrun(args):
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "auto" else 0) or 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               __file__, *without_nproc(sys.argv[1:])]
    sys.exit(subprocess.run(command).returncode)


def without_nproc(argv):
    """The options for the processes torchrun starts: --nproc is torchrun's business (and torchrun's own
    parser would take an abbreviated --nproc for --nproc-per-node)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: every GPU, or 2 on a CPU)")
    parser.add_argument("--min-bytes", type=common.parse_size, default=common.parse_size("1K"))
    parser.add_argument("--max-bytes", type=common.parse_size, default=common.parse_size("256M"))
    parser.add_argument("--factor", type=int, default=4, help="each message this many times the last")
    parser.add_argument("--budget", type=common.parse_size, default=common.parse_size("1G"),
                        help="bytes to all_reduce per size (sets the repeats, 5 to 200)")
    parser.add_argument("--model", default="net", help="whose gradients to compare with (a --model of the scripts)")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto",
                        help="auto: the GPUs where there are any (NCCL), else the CPU (gloo); cpu: gloo on the CPU")
    parser.add_argument("--records", type=Path, default=common.DEFAULT_RECORDS)
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if args.device == "auto" else 0
    if gpus and args.nproc and args.nproc > gpus:
        parser.error(f"--nproc {args.nproc} needs {args.nproc} GPUs, this machine has {gpus}; "
                     f"use --nproc {gpus} or --device cpu")
    return args


def main():
    args = parse_args()
    if "RANK" not in os.environ:
        relaunch_under_torchrun(args)
    device, backend = setup(args.device)
    world_size, is_main = dist.get_world_size(), dist.get_rank() == 0
    load_before = common.load_average()
    rows = sweep(message_sizes(args.min_bytes, args.max_bytes, args.factor), device, args.budget)
    gradients = gradient_allreduce(device, args.model, iterations=50)
    if is_main:
        print_table(rows, world_size, backend)
        print_gradient_comparison(gradients, rows)
        common.write_record(args.records, "allreduce", {
            "benchmark": "allreduce_bandwidth", "world_size": world_size, "backend": backend,
            "device": device.type, "threads_per_process": torch.get_num_threads(),
            "hardware": common.hardware(), "load_average": [load_before, common.load_average()],
            "sizes": rows, "gradients": gradients,
        })
    dist.barrier()  # leave together, then free the group (it joins its gloo threads)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
