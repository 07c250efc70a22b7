"""The checks of 04_ddp.ipynb's exercises: a checkpoint saved with DDP's prefix loaded into the plain Net, DDP's buckets
against those it built, and the participant's save and load of a DDP run, run in 2 processes. Notebook support: a
learner may skip this module.
"""
import copy
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from . import in_processes
from .registry import exercise


@exercise(1, answers=("rescued",))
def check_rescued(rescued, checkpoint):
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert all(key.startswith("module.") for key in saved), "the file itself should stay as it was saved"
    assert isinstance(rescued, torch.nn.Module), "rescued should be the plain Net, with the weights loaded"
    state = rescued.state_dict()
    assert sorted(f"module.{key}" for key in state) == sorted(saved), "rescued has other parameters than the file"
    for key, value in state.items():
        assert torch.equal(value.cpu(), saved[f"module.{key}"]), f"rescued's {key} is not the one in the file"
    return ("The plain Net holds every tensor of the file. Strip the prefix when loading "
            "(consume_prefix_in_state_dict_if_present), and save model.module.state_dict() from now on.")


BACKWARD_ORDER = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight",
                  "conv2.weight", "conv2.bias", "conv1.weight", "conv1.bias"]


@exercise(2, answers=("predict_buckets",))
def check_predict_buckets(predict_buckets, observed):
    numels = [observed["parameter_numels"][name] for name in BACKWARD_ORDER]
    mib = 2**20
    default = list(predict_buckets(numels, [1 * mib, 25 * mib]))
    explicit = list(predict_buckets(numels, [25 * mib]))
    assert default == observed["bucket_numels"][1], (
        f"with the default caps you predict {default}; DDP built {observed['bucket_numels'][1]}")
    assert explicit == observed["explicit_cap_25_numels"], (
        f"with bucket_cap_mb=25 you predict {explicit}; DDP built {observed['explicit_cap_25_numels']}")
    return (f"Defaults: {default}, as DDP built them. With bucket_cap_mb=25 the whole Net (4.8 MB) fits in the "
            f"first bucket, {explicit}: one all_reduce that waits for the whole backward, so nothing overlaps. "
            "Small buckets pay many latencies, large ones start late; for this model, the small first bucket "
            "of the default is what creates the overlap.")


# ---------------------------------------------------------------- exercise 3: save and load, in 2 processes
# The check watches the participant's torch.save, torch.load, and the barriers and collectives of torch.distributed
# through wrappers, in each process:
# - rank 0's torch.save first creates the file, empty, as the real one's open() does, then waits until every other
#   rank has gone as far as it can without the file: to a barrier or collective rank 0 has not reached yet, or to
#   torch.load. A missing barrier then always shows as a read before the file was written, whatever the timing, also
#   for a rank that polls for the file instead;
# - every barrier or collective first meets the other ranks at marker files in `work`: a rank that misses one, or
#   calls another one there, is named instead of pairing with the next collective, so no wrong answer leaves the
#   process group out of step. dist.barrier is the markers alone; a collective then runs for real;
# - the other ranks' torch.save records the call but writes nothing, so two writers never share the file.
# After the participant's code, one all_gather_object shares what each rank saw, and every rank gives one verdict.

MARKER_WAIT_SECONDS = 20  # for a rank that never comes; less than the process group's timeout (in_processes)
READ_WAIT_SECONDS = 5  # after a write no rank waited for: how long a rank that polls for the file has to read it
BARRIERS = ("barrier", "monitored_barrier")  # the markers alone
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list")
POINT_TO_POINT = ("send", "recv", "isend", "irecv")  # each rank's own call, paired with another kind of the four


class ReadBeforeWritten(Exception):
    """torch.load, on a rank that reached it before rank 0 had written the file."""


class MissedBarrier(Exception):
    """A rank waited at a barrier or collective for a rank that finished without calling it, or called another."""


def save_and_load_in_rank(answer, work):
    """In each of 2 processes: train a small model in DDP with Adam for two steps, call the participant's save,
    then load into a fresh plain model and optimizer; both must hold what was trained, on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ddp_model = DDP(small_model())
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)  # each rank its own shard
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(torch.randn(8, 4, generator=generator)),
                        torch.randint(2, (8,), generator=generator)).backward()
        optimizer.step()
    trained = copy.deepcopy((ddp_model.module.state_dict(), optimizer.state_dict()))
    torch.manual_seed(1)  # a fresh model with other weights, and an optimizer with no state yet
    model = small_model()
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    path, device = work / "checkpoint.pt", torch.device("cpu")
    watch = Watch(work, rank, world)
    error = None
    with in_processes.replaced(answer, watch.wrappers()):
        try:
            answer.save(ddp_model, optimizer, path)
            answer.load(model, fresh, path, device)
        except ReadBeforeWritten:
            watch.seen["read_early"] = True
        except MissedBarrier as missed:
            watch.seen["barrier"] = str(missed)
        except Exception as raised:  # noqa: BLE001 (said in one line, as the worker would, after the ranks agree)
            error = in_processes.raised_line(raised, rank)
        finally:
            watch.mark(f"done-{rank}")
    watch.seen["error"] = error
    watch.seen["model"] = same(model.state_dict(), trained[0])
    watch.seen["optimizer"] = same(fresh.state_dict(), trained[1])
    seen = [None] * world
    dist.all_gather_object(seen, watch.seen)  # the one collective after the participant's code, on every rank
    problem = save_and_load_problem(seen)
    if problem:
        raise in_processes.Wrong(problem)
    return {"tensors": len(trained[0]), "moments": sorted(next(iter(trained[1]["state"].values())))}


def small_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def save_and_load_problem(seen):
    """The first thing wrong, from what every rank saw (the same on every rank)."""
    savers = [rank for rank, s in enumerate(seen) if s["saved"]]
    early = [rank for rank, s in enumerate(seen) if s["read_early"]]
    no_map = [rank for rank, s in enumerate(seen) if s["no_map_location"]]
    barrier = next((s["barrier"] for s in seen if s["barrier"]), None)
    error = next((s["error"] for s in seen if s["error"]), None)
    model = [rank for rank, s in enumerate(seen) if not s["model"]]
    optimizer = [rank for rank, s in enumerate(seen) if not s["optimizer"]]
    if savers not in ([], [0]):
        return (f"{'every rank' if len(savers) == len(seen) else f'rank(s) {savers}'} called torch.save: the ranks "
                "hold the same weights, so rank 0 alone should write the file while the others wait")
    if seen[0]["prefixed"]:
        return ("the saved keys start with `module.`: that is the DDP wrapper's state_dict; save the model inside "
                "it, which loads into a model without DDP")
    if early:
        return (f"rank {early[0]} reached torch.load before rank 0 had written the file: after rank 0's torch.save, "
                "every rank calls dist.barrier()")
    if error:  # before what follows, which a rank that raised causes on the others
        return error
    if not savers:
        return "no rank called torch.save: rank 0 writes the model's and the optimizer's state_dicts to `path`"
    if barrier:
        return barrier
    if no_map:
        return (f"rank {no_map[0]} called torch.load without map_location: on GPUs each tensor loads back onto the "
                "device it was saved from, cuda:0 on every rank; give it this rank's device")
    unsafe = [rank for rank, s in enumerate(seen) if s["unsafe_load"]]
    if unsafe:
        return (f"rank {unsafe[0]} called torch.load with weights_only=False, which lets the file run code as it "
                "loads: a checkpoint of tensors and plain types needs no more than weights_only=True, the default")
    if model:
        return (f"after `load`, rank {model[0]}'s model does not hold the trained weights: on every rank, load the "
                "saved state_dict into `model`")
    if optimizer:
        return (f"after `load`, rank {optimizer[0]}'s optimizer state (Adam's moving averages and step count) is not "
                "the trained one: save the optimizer's state_dict too, and load it into `optimizer` on every rank")
    return None


def sync_kind(name):
    """What two ranks' calls must agree on to meet: a barrier, a point-to-point pair, or the same collective."""
    return "barrier" if name in BARRIERS else "send/recv" if name in POINT_TO_POINT else name


class Watch:
    """The wrappers of one answer on one rank, and what they saw."""

    def __init__(self, work, rank, world):
        self.markers, self.rank, self.world = work / "markers", rank, world
        self.markers.mkdir(exist_ok=True)
        self.syncs = 0  # how many barriers and collectives this rank has called
        self.seen = {"saved": False, "prefixed": False, "read_early": False, "no_map_location": False,
                     "unsafe_load": False, "barrier": None}
        self.real = {"save": torch.save, "load": torch.load}

    def wrappers(self):
        """What replaces torch.save, torch.load, and the barriers and collectives while the participant's code
        runs."""
        wrappers = {(torch, "save"): self.save, (torch, "load"): self.load}
        for name in BARRIERS + COLLECTIVES + POINT_TO_POINT:
            wrappers[(dist, name)] = functools.partial(self.sync, name, getattr(dist, name))
        return wrappers

    def mark(self, name, text=""):
        """A marker file, written whole before it appears under its name."""
        partial = self.markers / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, self.markers / name)

    def marked(self, name):
        return (self.markers / name).exists()

    def save(self, obj, f, *args, **kwargs):
        self.seen["saved"] = True
        self.seen["prefixed"] = self.seen["prefixed"] or prefixed(obj)
        if self.rank != 0:
            return None  # recorded; the file stays rank 0's
        if not self.marked("saved"):  # the first save: wait until the others can go no further without the file
            if isinstance(f, (str, os.PathLike)):
                open(f, "wb").close()  # as the real torch.save's open(): from here on the file is there, empty
            others = range(1, self.world)
            came = [self.wait_for(lambda o=other: self.marked(f"sync-{o}-{self.syncs + 1}")
                                  or self.marked(f"load-{o}") or self.marked(f"done-{o}")) for other in others]
            self.real["save"](obj, f, *args, **kwargs)
            if not all(came):  # a rank went on by another way: one that polls for the file reads it now, too early
                for other in others:
                    self.wait_for(lambda o=other: self.marked(f"load-{o}") or self.marked(f"done-{o}"),
                                  READ_WAIT_SECONDS)
        else:
            self.real["save"](obj, f, *args, **kwargs)
        self.mark("saved")
        return None

    def load(self, f, *args, **kwargs):
        early = not self.marked("saved")  # checked before the marker below, which rank 0's save waits for
        self.mark(f"load-{self.rank}")
        if early:
            raise ReadBeforeWritten
        if (args[0] if args else kwargs.get("map_location")) is None:
            self.seen["no_map_location"] = True
        if kwargs.get("weights_only") is False:
            self.seen["unsafe_load"] = True
        return self.real["load"](f, *args, **kwargs)

    def sync(self, name, real, *args, **kwargs):
        """dist.<name>: leave this rank's marker, and go on once every other rank has left its own for the same
        call; a collective then runs for real, a barrier has done its work."""
        self.syncs += 1
        self.mark(f"sync-{self.rank}-{self.syncs}", name)
        for other in range(self.world):
            if other == self.rank:
                continue
            theirs = self.markers / f"sync-{other}-{self.syncs}"
            self.wait_for(lambda o=other, t=theirs: t.exists() or self.marked(f"done-{o}"))
            if not theirs.exists():
                raise MissedBarrier(
                    f"rank {self.rank} waited at dist.{name}() for rank {other}, which never reached it: a barrier "
                    "works only when every rank calls it, as often")
            if sync_kind(theirs.read_text()) != sync_kind(name):
                raise MissedBarrier(
                    f"rank {self.rank} called dist.{name}() where rank {other} called dist.{theirs.read_text()}(): "
                    "every rank calls the same barriers and collectives, in the same order")
        return None if name in BARRIERS else real(*args, **kwargs)

    @staticmethod
    def wait_for(condition, seconds=MARKER_WAIT_SECONDS):
        """Poll ``condition`` until it holds (True) or ``seconds`` pass (False): a rank that never comes costs that
        long, never a wrong verdict for one that does."""
        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True


def prefixed(obj):
    """Whether any dict in ``obj`` has a key starting with "module.", as DDP's own state_dict does."""
    if isinstance(obj, dict):
        return any(isinstance(key, str) and key.startswith("module.") for key in obj) or \
            any(prefixed(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(prefixed(value) for value in obj)
    return False


def same(got, expected):
    """Equal nested state: the same keys, equal tensors (values and device), equal plain values."""
    if isinstance(expected, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.device == expected.device and got.shape == expected.shape \
            and torch.equal(got, expected)
    if isinstance(expected, dict):
        return isinstance(got, dict) and got.keys() == expected.keys() and all(same(got[k], v)
                                                                               for k, v in expected.items())
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(map(same, got, expected))
    return got == expected


@exercise(3, answers=("save", "load"), rank_check=save_and_load_in_rank)
def check_save_and_load(save, load):
    detail = in_processes.run_check(save_and_load_in_rank, save=save, load=load)
    *moments, last = detail["moments"]
    return (f"in 2 processes, rank 0 wrote the model's {detail['tensors']} tensors and Adam's state "
            f"({', '.join(moments)} and {last} for each parameter) while rank 1 waited, and both ranks loaded "
            "them onto their own device. Without the optimizer's state, a resumed Adam starts its averages from "
            "zero: notebook 05 saves the whole training state.")
