"""Benchmark: training time until the baseline first reaches a target test accuracy.

    python benchmarks/time_to_accuracy.py --target 0.95 --repeats 3

Compares, on the same machine in the same run and with the same model (the Net):
  pytorch-examples  the pytorch/examples MNIST recipe (github.com/pytorch/examples, mnist/main.py):
                    a DataLoader with per-sample transforms, Adadelta lr 1.0, StepLR gamma 0.7, batch 64
  course            the course default: whole data set in memory (TensorBatches), Adam,
                    the same StepLR decay, batch 64
and any recipe given with --recipe NAME:LOADER:OPTIMIZER:LR:BATCH.
The clock runs only during training steps: the test set is scored every
--eval-every steps with the clock stopped. Repeat k uses seed --seed + k (95% sits
close to where this model levels off on 1,000 test images, so single runs vary a lot
and the median over seeds is what to compare). Recipes alternate within each repeat,
so a slower or busier moment of the machine hits every recipe alike.
"""
import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repository root, not this folder, goes on sys.path (__init__.py)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
import torch  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from benchmarks import common, report  # noqa: E402
from lesson import data, loop, models, process  # noqa: E402
from machinery import cli  # noqa: E402

RECIPES = {
    "pytorch-examples": ("dataloader", "adadelta", 1.0, 64),
    "course": ("tensor", "adam", 2e-3, 64),
}


def parse_recipe(text):
    name, loader, optimizer, lr, batch = text.split(":")
    return name, (loader, optimizer, float(lr), int(batch))


def run_once(recipe, train_set, test_set, args, runtime, seed):
    loader, optimizer_name, lr, batch_size = recipe
    # The scripts' own flags, so that every flag the lesson reads has the default a run of step 1 has.
    run_args = cli.parse_args(["--loader", loader, "--optimizer", optimizer_name, "--lr", str(lr),
                               "--batch-size", str(batch_size), "--seed", str(seed), "--device", "cpu"])
    model = models.build_model(run_args)  # seeded from seed: every recipe starts from the same weights
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=seed)
    batches = data.train_batches(train_set, sampler, batch_size, run_args, runtime.device)
    optimizer, scheduler = loop.make_optimizer(model, run_args)
    clock, steps = 0.0, 0
    for epoch in range(1, args.max_epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        started = time.perf_counter()
        for images, labels in batches:
            loop.train_step(model, optimizer, images, labels)
            steps += 1
            if steps % args.eval_every == 0:
                clock += time.perf_counter() - started
                accuracy = loop.evaluate(model, test_set, runtime, 500)["test_accuracy"]
                if accuracy >= args.target:
                    return {"seconds": clock, "steps": steps, "epochs": steps / len(batches), "accuracy": accuracy}
                model.train()
                started = time.perf_counter()
        clock += time.perf_counter() - started
        scheduler.step()
    return {"seconds": None, "steps": steps, "epochs": args.max_epochs, "accuracy": accuracy}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=5, help="score the test set every this many steps")
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", action="append", default=[], type=parse_recipe)
    parser.add_argument("--records", type=Path, default=common.DEFAULT_RECORDS, help="where the JSON record goes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipes = dict(RECIPES, **dict(args.recipe))
    runtime = process.Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                                  backend=None, threads=args.threads, timeout=datetime.timedelta(seconds=300))
    train_set, test_dataset = data.load_datasets("mnist5k", common.REPO / "data")
    test_set = loop.TestSet(test_dataset, runtime)
    runs = {name: [] for name in recipes}
    load_before = common.load_average()
    for repeat in range(args.repeats):
        for name, recipe in recipes.items():
            result = run_once(recipe, train_set, test_set, args, runtime, args.seed + repeat)
            runs[name].append(result)
            print(f"repeat {repeat + 1}: {name:<16} {result}", flush=True)
    record = {"benchmark": "time_to_accuracy", "hardware": common.hardware(), "threads": args.threads,
              "target": args.target, "eval_every": args.eval_every, "repeats": args.repeats,
              "load_average": [load_before, common.load_average()], "recipes": recipes, "runs": runs,
              "summary": {name: summarize(results) for name, results in runs.items()}}
    print(f"\ntime to {args.target:.0%} test accuracy, mnist5k, one process:\n" + report.render(record))
    common.write_record(args.records, "time_to_accuracy", record)


def summarize(results):
    """Medians over seeds; no time when any seed never reached the target."""
    seconds = [r["seconds"] for r in results if r["seconds"] is not None]
    return {"median_seconds": statistics.median(seconds) if len(seconds) == len(results) else None,
            "median_steps": statistics.median(r["steps"] for r in results)}


if __name__ == "__main__":
    main()
