"""Figures from benchmark records: scaling, step-time split and all_reduce bandwidth.

    python benchmarks/plots.py                                  # from benchmarks/results/ into figs/
    python benchmarks/plots.py --records results/benchmarks     # fresh records, figures beside them

Each figure is drawn from the newest record of its kind in --records. From the committed
records the figures go to figs/ (the ones docs/performance.md shows; notebook 08 draws the same figures
from the same records, so `make figures` gives the same files); from any other folder, into
<records>/figs, so that a local measurement never overwrites the committed figures.
"""
import argparse
import sys
import textwrap
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repository root, not this folder, goes on sys.path (__init__.py)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import matplotlib  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import common, report  # noqa: E402

FIGS = common.REPO / "figs"


def save(fig, figs_dir, name):
    figs_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(figs_dir / name, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    print(f"saved {common.display_path(figs_dir / name)}")


def scaling_rows(record, model):
    """{method: [(devices, samples/s, efficiency)]} from the harness record's scaling runs."""
    rows, gpus = record["rows"], record["machine"]["gpus"]
    unit = report.find(rows, model=model, method="one process", processes=1,
                       threads=None if gpus else 1, role="scaling")
    lines = {}
    for row in rows:
        if row["model"] == model and row["role"] == "scaling":
            devices = report.devices_used(row, gpus)
            efficiency = row["samples_per_second"] / (devices * unit["samples_per_second"]) if unit else None
            lines.setdefault(row["method"], []).append((devices, row["samples_per_second"], efficiency))
    return lines


def scaling_figure(record, model="net"):
    """Throughput and scaling efficiency against the devices used."""
    lines = scaling_rows(record, model)
    unit_name = "GPUs" if record["machine"]["gpus"] else "CPU cores (processes x threads)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, points in lines.items():
        points.sort()
        devices, throughput, efficiency = zip(*points)
        style = "o-" if len(points) > 1 else "o"
        left.plot(devices, throughput, style, label=method)
        if efficiency[0] is not None:
            right.plot(devices, efficiency, style, label=method)
    left.set(xlabel=unit_name, ylabel="samples/s", title=f"Throughput ({record['models'][model]['description']})")
    right.set(xlabel=unit_name, ylabel="samples/s per device / one device's", title="Scaling efficiency", ylim=(0, 1.2))
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in (left, right):
        ax.set_xticks(sorted({d for points in lines.values() for d, _, _ in points}))
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(report.machine_line(record), fontsize=9)
    return fig


def step_split_figure(record, model="net"):
    """Each method's step at the largest world size: compute, and the communication left exposed."""
    rows, gpus = record["rows"], record["machine"]["gpus"]
    world = report.largest_world(rows, model)
    chosen = [row for row in rows if row["model"] == model and row["role"] == "scaling"
              and (row["processes"] == world or row["method"] == "one process") and row["method"] != "DataParallel"]
    labels, compute, communication = [], [], []
    for row in chosen:
        reference = report.compute_reference(rows, row, gpus)
        total = row["step_seconds"] * 1e3
        reference = total if reference is None else reference * 1e3
        separable = reference <= total  # else other work slowed the runs unevenly (see report.step_split)
        reference = min(reference, total)
        labels.append(f"{textwrap.fill(row['method'], 14)}\n{report.layout_text(row, gpus)}"
                      + ("" if separable else "\n(no split)"))
        compute.append(reference)
        communication.append(max(total - reference, 0.0))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(labels, compute, label="compute (the same step with no communication)")
    ax.bar(labels, communication, bottom=compute, label="communication and its overhead, exposed")
    ax.set(ylabel="ms per step", title=f"Where a step's time goes, batch {chosen[0]['batch_size']} per process")
    ax.set_ylim(0, 1.3 * max(c + m for c, m in zip(compute, communication)))  # room for the legend
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(report.machine_line(record), fontsize=9)
    return fig


def allreduce_figure(record):
    """The sweep's time and bandwidth against message size, with the course's gradient all_reduce."""
    sizes = [row["bytes"] for row in record["sizes"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.loglog(sizes, [row["seconds"] * 1e6 for row in record["sizes"]], "o-")
    left.set(xlabel="message size (bytes)", ylabel="time per all_reduce (us)", title="Latency, then bandwidth")
    right.semilogx(sizes, [row["busbw_gbps"] for row in record["sizes"]], "o-", label="busbw (sweep)")
    right.semilogx(sizes, [row["algbw_gbps"] for row in record["sizes"]], "x--", label="algbw (sweep)")
    g = record["gradients"]
    right.semilogx([g["bytes"]], [g["bucket"]["busbw_gbps"]], "r*", ms=12, label="the Net's gradients, one bucket")
    right.semilogx([g["bytes"]], [g["per-parameter"]["busbw_gbps"]], "k^", label="the Net's gradients, per parameter")
    right.set(xlabel="message size (bytes)", ylabel="GB/s", title=f"Bandwidth, {record['world_size']} ranks, "
              f"{record['backend']} (busbw = algbw x 2(n-1)/n)")
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    right.legend(fontsize=8)
    fig.suptitle(report.machine_line(record), fontsize=9)
    return fig


def main(argv=None):
    matplotlib.use("Agg")  # files only (a notebook importing this module keeps its own backend)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, default=common.COMMITTED_RECORDS)
    parser.add_argument("--figs", type=Path, default=None, help="where the figures go (default: see above)")
    args = parser.parse_args(argv)
    committed = args.records.resolve() == common.COMMITTED_RECORDS.resolve()
    figs_dir = args.figs or (FIGS if committed else args.records / "figs")
    harness = common.latest_record(args.records, "harness")
    allreduce = common.latest_record(args.records, "allreduce")
    if harness:
        save(scaling_figure(harness), figs_dir, "benchmark_scaling.png")
        save(step_split_figure(harness), figs_dir, "benchmark_step_split.png")
    if allreduce:
        save(allreduce_figure(allreduce), figs_dir, "allreduce_bandwidth.png")
    if not (harness or allreduce):
        print(f"no harness or allreduce record in {common.display_path(args.records)}: nothing to plot")


if __name__ == "__main__":
    main()
