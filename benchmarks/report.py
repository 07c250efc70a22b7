"""Tables and targets from benchmark records: what `make benchmark` prints and docs/performance.md quotes.

    python benchmarks/report.py benchmarks/results/harness-20260101-120000.json   # print its tables
    python benchmarks/report.py --update-page                                      # refresh docs/performance.md

docs/performance.md holds blocks of the form

    <!-- record: benchmarks/results/NAME.json -->
    ...tables rendered from that record...
    <!-- /record -->

and a test checks that each block is exactly what ``render`` makes of its committed record, so
the page can quote only numbers that are in the repository.
"""
import argparse
import json
import re
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repository root, not this folder, goes on sys.path (__init__.py)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks import common  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- record: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- /record -->)", re.S)

# The targets, each a ratio measured side by side in one harness run.
DDP_VS_THREADS_GOAL = 0.95
OVERLAP_VS_DDP_GOAL = 1.05
RECIPE_SPEEDUP_GOAL = 20.0
CPU_MFU_GOAL = 0.70
ONE_PROCESS = "not judged: one process, no gradient crosses to another device (needs 2 or more GPUs)"
# The runs the communication targets compare, each as harness.py's METHODS runs it, so that a target whose run is
# missing names the run (tests/test_benchmarks.py checks that the two tables agree).
COMPARED_RUNS = {
    "all_reduce per-parameter": "step2_allreduce.py --mode per-parameter",
    "all_reduce bucket": "step2_allreduce.py --mode bucket",
    "all_reduce overlap": "step2b_own_ddp.py --mode overlap",
    "all_reduce overlap-bucket": "step2b_own_ddp.py --mode overlap-bucket",
    "DDP": "step4_ddp.py",
}


def find(rows, **criteria):
    """The first row matching every criterion, or None."""
    return next((row for row in rows if all(row.get(k) == v for k, v in criteria.items())), None)


def largest_world(rows, model):
    sizes = [row["processes"] for row in rows if row["model"] == model and row["role"] == "scaling"
             and row["method"] not in ("one process", "DataParallel")]
    return max(sizes, default=None)


def target(name, measured, goal, met, note=""):
    return {"name": name, "measured": measured, "goal": goal, "met": met, "note": note}


def skipped(name, goal, why):
    return target(name, None, goal, None, why)


def check_targets(record):
    """Each target as measured in this record: met True/False, or None with the reason it was not judged."""
    rows, gpus = record["rows"], record["machine"]["gpus"]
    model = "net"
    world = largest_world(rows, model)
    step = {m: (find(rows, model=model, method=m, processes=world, role="scaling") or {}).get("step_seconds")
            for m in COMPARED_RUNS}
    targets = [ddp_against_threads(rows, gpus, world), *overlap_targets(step, world),
               recipe_speedup(rows, gpus), baseline_mfu(rows, gpus, record["machine"]["cores"])]
    return [unjudged_when_busy(t, record) for t in targets]


def oversubscribed(record):
    """The highest load average while measuring, if it exceeded the CPU cores (else None). On a CPU
    run, more runnable work than cores means the runs shared their cores with other jobs."""
    load = (record.get("load_average") or {}).get("max")
    cores = record["machine"]["cores"]
    return load if load is not None and not record["machine"]["gpus"] and load > cores else None


def unjudged_when_busy(measured, record):
    """A ratio measured while other work outnumbered the cores is shown, but not judged."""
    load = oversubscribed(record)
    if load is None or measured["met"] is None:
        return measured
    return {**measured, "met": None,
            "note": f"not judged: load average up to {load:.1f} on {record['machine']['cores']} cores"}


def ddp_against_threads(rows, gpus, world):
    goal = f">= {DDP_VS_THREADS_GOAL}"
    if gpus:
        return skipped("DDP N processes x 1 thread / 1 process x N threads, same global batch", goal, "a CPU target")
    name = f"DDP {world or 'N'} processes x 1 thread / 1 process x {world or 'N'} threads, same global batch"
    ddp = find(rows, model="net", method="DDP", processes=world, role="scaling")
    single = find(rows, model="net", method="one process", role="same global batch")
    if not (ddp and single):
        return skipped(name, goal, "DDP or the one-process run is missing")
    ratio = ddp["samples_per_second"] / single["samples_per_second"]
    return target(name, ratio, goal, ratio >= DDP_VS_THREADS_GOAL)


def overlap_targets(step, world):
    """The targets on hiding communication, each judged where both of its steps were measured."""
    processes = count(world or "N", "process", "{} processes")  # "N": no distributed run in the record
    results = [step_ratio(f"overlap-bucket step / DDP step, {processes}", step, "all_reduce overlap-bucket", "DDP",
                          f"<= {OVERLAP_VS_DDP_GOAL}", lambda ratio: ratio <= OVERLAP_VS_DDP_GOAL),
               step_ratio("after-backward bucket step / overlap-bucket step", step, "all_reduce bucket",
                          "all_reduce overlap-bucket", "> 1", lambda ratio: ratio > 1),
               per_parameter_against_the_rest(step)]
    if world == 1:  # one GPU: an all_reduce with no peer moves no gradient between devices, so the steps differ
        # only by each method's own overhead, which says nothing about hiding communication
        results = [t if t["met"] is None else {**t, "met": None, "note": ONE_PROCESS} for t in results]
    return results


def step_ratio(name, step, numerator, denominator, goal, met):
    """The step of one method over another's, judged by ``met``; not measured where either run is missing."""
    missing = [method for method in (numerator, denominator) if step[method] is None]
    if missing:
        return skipped(name, goal, missing_runs(missing))
    ratio = step[numerator] / step[denominator]
    return target(name, ratio, goal, met(ratio))


def per_parameter_against_the_rest(step):
    name, per_parameter_run = "per-parameter step / slowest other method's step", "all_reduce per-parameter"
    per_parameter = step[per_parameter_run]
    others = [method for method in step if method != per_parameter_run]
    measured = [step[method] for method in others if step[method] is not None]
    if per_parameter is None or not measured:
        return skipped(name, "> 1", missing_runs([per_parameter_run] if per_parameter is None else others))
    return target(name, per_parameter / max(measured), "> 1", per_parameter > max(measured))


def missing_runs(methods):
    """Why a target was not measured: the runs of ``methods`` that this record lacks, and what each runs."""
    return "no run of " + ", nor of ".join(f"{method} ({COMPARED_RUNS[method]})" for method in methods)


def recipe_speedup(rows, gpus):
    name = "one GPU: course baseline samples/s / pytorch/examples recipe samples/s"
    goal = f">= {RECIPE_SPEEDUP_GOAL:.0f}"
    if not gpus:
        return skipped(name, goal, "a GPU target: no GPU here")
    course = find(rows, model="net", method="one process", processes=1, role="scaling")
    recipe = find(rows, model="net", method="one process, pytorch/examples recipe", role="scaling")
    if not (course and recipe):
        return skipped(name, goal, "a run is missing")
    ratio = course["samples_per_second"] / recipe["samples_per_second"]
    return target(name, ratio, goal, ratio >= RECIPE_SPEEDUP_GOAL)


def baseline_mfu(rows, gpus, cores):
    name, goal = f"CPU baseline (1 process x {cores} threads): share of the measured matrix-product peak", \
        f">= {CPU_MFU_GOAL}"
    if gpus:
        return skipped(name, goal, "a CPU target")
    row = find(rows, model="net", method="one process", processes=1, threads=cores, role="scaling")
    if not row or row.get("mfu") is None:
        return skipped(name, goal, "the record has no MFU")
    return target(name, row["mfu"], goal, row["mfu"] >= CPU_MFU_GOAL)


# ---- rendering -------------------------------------------------------------------------------

def machine_line(record):
    hw = record["hardware"]
    gpus = f"{len(hw['gpus'])} x {hw['gpus'][0]}" if hw.get("gpus") else "no GPU"
    return f"{hw['cpu']}, {hw['cpu_cores']} cores, {gpus}, torch {hw['torch']}"


def layout_text(row, gpus):
    if gpus:
        if row["method"] == "DataParallel":
            return f"{count(gpus, 'GPU', '{} GPUs')}, 1 process"
        return f"{row['processes']} x 1 GPU"
    return f"{row['processes']} x {row['threads']} thread{'s' if row['threads'] > 1 else ''}"


def devices_used(row, gpus):
    if gpus:
        return gpus if row["method"] == "DataParallel" else row["processes"]
    return row["processes"] * row["threads"]


def compute_reference(rows, row, gpus):
    """The step of the same layout with no communication (see harness.py), or None."""
    if row["method"] in ("one process", "one process, pytorch/examples recipe", "DataParallel"):
        return row["step_seconds"] if row["method"] != "DataParallel" else None
    if gpus:
        single = find(rows, model=row["model"], method="one process", processes=1, batch_size=row["batch_size"])
    else:
        single = find(rows, model=row["model"], role="compute only", processes=row["processes"],
                      threads=row["threads"], batch_size=row["batch_size"])
    return single["step_seconds"] if single else None


def step_split(rows, row, gpus):
    compute = compute_reference(rows, row, gpus)
    total = row["step_seconds"] * 1e3
    ms = "{:.1f}" if total < 10 else "{:.0f}"  # a GPU's steps of a few ms: tenths, or the sum cannot be read
    if compute is None:
        return ms.format(total)
    if compute * 1e3 > total:  # the difference means nothing: other work slowed the runs unevenly, or the method
        # does less per batch (no_sync accumulation steps the optimizer once per K batches)
        return f"{ms.format(total)} (no split: the step without communication took {ms.format(compute * 1e3)})"
    return f"{ms.format(total)} = {ms.format(compute * 1e3)} + {ms.format(total - compute * 1e3)}"


def percent(value):
    return "n/a" if value is None else f"{value:.1%}"


def count(n, one, many):
    """'1 epoch', '3 epochs': ``many`` is a format with one {} for n."""
    return f"1 {one}" if n == 1 else many.format(n)


def steps_text(spec):
    """' of 20 steps' where a model's epochs are cut short (its s/epoch is then for those steps)."""
    return f" of {spec['max_steps']} steps" if spec.get("max_steps") else ""


def seconds(value):
    return "not reached" if value is None else f"{value:.1f} s"


def scaling_table(record, model):
    rows, gpus = record["rows"], record["machine"]["gpus"]
    unit = find(rows, model=model, method="one process", processes=1, threads=1 if not gpus else None, role="scaling")
    # Made-up data has no accuracy worth reaching (older records wrote its target as 0): no such column.
    target_accuracy = record["models"][model]["target_accuracy"] or None
    time_column = [] if target_accuracy is None else [f"time to {target_accuracy:.0%}"]
    header = ["method", f"processes x {'GPUs' if gpus else 'threads'}", "global batch", "samples/s", "s/epoch",
              "step ms = compute + communication", "MFU", *time_column, "scaling efficiency"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if row["model"] != model or row["role"] == "compute only":
            continue
        efficiency = (f"{row['samples_per_second'] / (devices_used(row, gpus) * unit['samples_per_second']):.0%}"
                      if unit else "n/a")
        time_cell = [] if target_accuracy is None else [seconds(row["time_to_target"])]
        cells = [row["method"], layout_text(row, gpus), f"{row['global_batch_size']:.0f}",
                 f"{row['samples_per_second']:,.0f}", f"{row['seconds_per_epoch']:.2f}", step_split(rows, row, gpus),
                 percent(row["mfu"]), *time_cell, efficiency]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_table(targets):
    lines = ["| target | measured | goal | met |", "|---|---|---|---|"]
    for t in targets:
        measured = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        met = {True: "yes", False: "**no**", None: t["note"] if t["note"].startswith("not judged") else
               f"not measured: {t['note']}"}[t["met"]]
        lines.append(f"| {t['name']} | {measured} | {t['goal']} | {met} |")
    return "\n".join(lines)


def render_harness(record):
    load = record["load_average"]["max"]
    parts = [f"{machine_line(record)}; {count(record['repeats'], 'repeat', 'median of {} repeats')}; "
             f"highest 1-minute load average while measuring: {load:.2f}."]
    for model, spec in record["models"].items():
        if any(row["model"] == model for row in record["rows"]):
            epochs = count(record["epochs"][model], "epoch", "{} epochs")
            parts += [f"\n**{spec['description']}**, {epochs}{steps_text(spec)} per run, "
                      f"batch {spec['batch_size']} per process:\n", scaling_table(record, model)]
    parts += ["\n**Targets**\n", targets_table(check_targets(record))]
    if record["skipped"]:
        parts.append("\nSkipped (not accepted by the scripts yet, or not on this machine):\n")
        parts += [f"- {name}: {why}" for name, why in record["skipped"].items()]
    return "\n".join(parts)


def render_allreduce(record):
    lines = [f"{machine_line(record)}; {record['world_size']} processes, {record['backend']}, "
             f"{record['threads_per_process']} thread each; load average {record['load_average'][0]:.2f} before, "
             f"{record['load_average'][1]:.2f} after.\n",
             "| message | time | algbw GB/s | busbw GB/s |", "|---|---|---|---|"]
    for row in record["sizes"]:
        lines.append(f"| {common.format_size(row['bytes'])} | {row['seconds'] * 1e6:,.0f} us | {row['algbw_gbps']:.3f} "
                     f"| {row['busbw_gbps']:.3f} |")
    g = record["gradients"]
    lines.append(f"\nThe course's own gradient all_reduce ({g['model']}: {g['tensors']} tensors, "
                 f"{g['bytes'] / 2**20:.1f} MiB): one bucket {g['bucket']['seconds'] * 1e3:.1f} ms "
                 f"({g['bucket']['busbw_gbps']:.2f} GB/s busbw), one all_reduce per parameter "
                 f"{g['per-parameter']['seconds'] * 1e3:.1f} ms ({g['per-parameter']['busbw_gbps']:.2f} GB/s).")
    return "\n".join(lines)


# What the tables call each recipe of benchmarks/time_to_accuracy.py (older records name the first "seed-recipe").
RECIPE_NAMES = {"seed-recipe": "the pytorch/examples MNIST recipe",
                "pytorch-examples": "the pytorch/examples MNIST recipe",
                "course-recipe": "the course's default", "course": "the course's default"}


def render_time_to_accuracy(record):
    lines = [f"{machine_line(record)}; {record['threads']} threads; median of {record['repeats']} seeds; "
             f"load average {record['load_average'][0]:.2f} before, {record['load_average'][1]:.2f} after.\n",
             "| recipe | data path | optimizer | median time | median steps |", "|---|---|---|---|---|"]
    for name, summary in record["summary"].items():
        loader, optimizer, lr, batch = record["recipes"][name]
        path = {"dataloader": "DataLoader, per-sample transforms", "tensor": "whole set in memory"}[loader]
        lines.append(f"| {RECIPE_NAMES.get(name, name)} | {path} | {optimizer} lr {lr:g}, batch {batch} "
                     f"| {seconds(summary['median_seconds'])} | {summary['median_steps']:.0f} |")
    return "\n".join(lines)


def render_cpu_profile(record):
    seconds, flops, peak = record["seconds_per_step"], record["flops_per_step"], record["peak_flops"]
    total = sum(seconds.values())
    lines = [f"{machine_line(record)}; {record['threads']} threads, batch {record['batch_size']}, "
             f"{record['steps']} steps profiled; matrix-product peak {peak / 1e9:.0f} GFLOP/s; load average "
             f"{record['load_average'][0]:.2f} before, {record['load_average'][1]:.2f} after.\n",
             "| part of the step | ms per step | share | GFLOP/s | share of the peak |", "|---|---|---|---|---|"]
    names = {"convolution": "convolutions (forward and backward)", "matmul": "linear layers' matrix products",
             "elementwise and pooling": "the rest (element-wise, pooling, dropout, loss, autograd, profiler)",
             "optimizer": "optimizer (Adam)"}
    for group, name in names.items():
        rate = flops.get(group, 0) / seconds[group] if group in flops else None
        achieved = "-" if rate is None else f"{rate / 1e9:.0f}"
        share_of_peak = "-" if rate is None else f"{rate / peak:.0%}"
        lines.append(f"| {name} | {seconds[group] * 1e3:.1f} | {seconds[group] / total:.0%} | {achieved} "
                     f"| {share_of_peak} |")
    rate = sum(flops.values()) / total
    lines.append(f"| the whole step | {total * 1e3:.1f} | 100% | {rate / 1e9:.0f} | {rate / peak:.0%} |")
    return "\n".join(lines)


RENDERERS = {"harness": render_harness, "allreduce_bandwidth": render_allreduce,
             "time_to_accuracy": render_time_to_accuracy, "cpu_step_profile": render_cpu_profile}


def render(record):
    return RENDERERS[record["benchmark"]](record)


def page_blocks(text):
    """(record path, the page's body, the body its record renders to) for each block of ``text``."""
    for match in BLOCK.finditer(text):
        record = json.loads((REPO / match["path"]).read_text())
        yield match["path"], match["body"], render(record) + "\n"


def update_page(page=PAGE):
    text = page.read_text()
    text = BLOCK.sub(lambda m: m[1] + render(json.loads((REPO / m["path"]).read_text())) + "\n" + m[4], text)
    page.write_text(text)
    print(f"{page.relative_to(REPO)}: every record block rendered again from its record")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="*", type=Path, help="records to print as tables")
    parser.add_argument("--update-page", action="store_true", help="render docs/performance.md's record blocks again")
    args = parser.parse_args()
    if args.update_page:
        update_page()
    for path in args.records:
        print(render(json.loads(path.read_text())) + "\n")


if __name__ == "__main__":
    main()
