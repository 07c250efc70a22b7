"""The checks of 07_beyond_ddp.ipynb's exercises: the participant's DDP communication hook, which averages each
bucket in bfloat16, run in 2 processes; and ZeRO-1's optimizer state per rank, against what the demo measured.
Notebook support: a learner may skip this module.
"""
import contextlib
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lesson import models

from . import in_processes
from .gradients import flat_gradient
from .registry import exercise

ADAM_BYTES_PER_NUMBER = 8  # exp_avg and exp_avg_sq, float32 each


@exercise(2, answers=("zero_state_per_rank",))
def check_zero_state_per_rank(zero_state_per_rank, observed, parameter_numels):
    ranks = observed["ranks"]
    predicted = list(zero_state_per_rank(list(parameter_numels), len(ranks)))
    measured = [rank["zero"] for rank in ranks]
    assert len(predicted) == len(ranks), f"one number per rank, please: got {len(predicted)} for {len(ranks)} ranks"
    assert sum(predicted) == ranks[0]["adam"], (f"your ranks hold {sum(predicted):,} bytes together; Adam's whole "
                                                f"state is {ranks[0]['adam']:,}: every parameter's state lives on "
                                                "exactly one rank")
    assert predicted == measured, (f"you predict {predicted} bytes per rank; ZeroRedundancyOptimizer measured "
                                   f"{measured}. It hands out whole parameters, not equal slices")
    return (f"{measured}: ZeroRedundancyOptimizer gives whole parameters, largest first, to the rank holding the "
            "least so far. One 1.2M-number layer (fc1.weight) outweighs the rest of the Net, so one rank keeps "
            "almost everything: ZeRO-1 saves memory on models of many similar layers (transformers), not on "
            "this one. FSDP shards every parameter itself, so its shares are even.")


# ---------------------------------------------------------------- exercise 1: a communication hook that sends bf16

HOOK_SHARD = 8  # images per rank and backward
HOOK_BUCKET_MB = 0.05  # small buckets: once DDP has rebuilt them, the Net's gradients go out in 3 all_reduces
BF16_ROUNDING = 2.0 ** -8  # bfloat16 keeps 8 significant bits: rounding moves a number by at most 2^-8 of it
# A hook still running this long after its all_reduce call returned to it is waiting for the sum (see _PendingWork).
# A right hook returns microseconds after that call (the clock starts when the call returns, not while it waits for
# the other rank), so no load on the machine brings it near 10 s; a hook that waits would wait forever.
HOOK_STALL_SECONDS = 10.0
READ_TOO_EARLY = ("your hook read its all_reduce's future before its all_reduce completed: compute the average "
                  "in a callback, work.get_future().then(callback), which runs once the sum is there")
WAITS = ("your hook waits for its all_reduce (async_op=False, or wait(), torch.futures.wait_all or a loop on "
         "is_completed() inside the hook): backward stalls at every bucket; start it with async_op=True and return "
         "work.get_future().then(...), which DDP waits on at the end of backward")


class _ReadTooEarly(Exception):
    """The hook read the value of an all_reduce's future before the all_reduce had completed."""


class _PendingWork:
    """What an all_reduce started inside the participant's hook returns in this check (``dist.all_reduce(...,
    async_op=True)``, or a process group's own ``allreduce``): an all_reduce that, as far as the hook can see, has
    not completed. The real all_reduce has run already, at the call, on copies of the tensors. The sums are copied
    into the hook's tensors, and the future completed, when the hook waits for them (``wait()`` on the work, on its
    future or on one chained to it), when the hook is still running ``HOOK_STALL_SECONDS`` after the call returned
    (it waits by a route the stand-in does not see: ``torch.futures.wait_all``, a loop on ``is_completed()``...),
    or, at the latest, just after the hook has returned.

    Why this stands in for the real thing: a real asynchronous all_reduce completes at some moment after it
    starts, unknown to the hook, and until the hook waits for it, its tensor may still hold this rank's own
    values (on gloo it usually does, and sometimes a mix: a race). The stand-in always takes the latest moment the
    hook cannot see, just after it has returned, so what a real run gets most of the time, the check gets every
    time; and whichever way the hook waits, the wait ends, as it would in a real run. What the hook may rely on
    behaves as with a real Work: ``wait()`` returns once the sum is in the tensor, and callbacks added with
    ``get_future().then(...)`` run once it is, given a future whose value is the list of the summed tensors
    (``[tensor]``). The collectives themselves run when the hook calls them, in the order it calls them, the same
    on every rank (same code, same buckets), so the ranks stay in step whatever the hook does; completing a work
    only copies, so the watchdog thread that may do it never joins a collective."""

    def __init__(self, watch, tensors, sums):
        self.watch, self.tensors, self.sums = watch, tensors, sums
        self.future = _PendingFuture(self)

    def complete(self, waited=False):
        with self.watch.lock:
            if self.future.done():
                return
            if waited and self.watch.in_hook:
                self.watch.waited_in_hook = True
            for tensor, summed in zip(self.tensors, self.sums):
                tensor.copy_(summed)
            self.future.set_result(self.tensors)

    def wait(self, timeout=None):
        self.complete(waited=True)
        return True

    def get_future(self):
        return self.future

    def is_completed(self):
        return self.future.done()

    def result(self):
        return self.tensors


class _PendingFuture(torch.futures.Future):
    """The future of a ``_PendingWork``, or one chained to it with ``then`` (``from_then``): waiting on it completes
    the work first (a plain future would wait forever: nothing else completes it); its value is there once it has."""

    def __init__(self, work, from_then=False):
        super().__init__()
        self.work, self.from_then = work, from_then

    def wait(self):
        self.work.complete(waited=True)
        return super().wait()

    def value(self):
        if not self.done():
            raise _ReadTooEarly()
        return super().value()

    def then(self, callback):
        chained = _PendingFuture(self.work, from_then=True)

        def run(future):
            try:
                chained.set_result(callback(future))
            except Exception as error:  # noqa: BLE001 (as with torch's then: the chained future holds the error)
                chained.set_exception(error)

        self.add_done_callback(run)
        return chained


class _WatchedAllReduce:
    """The all_reduces of the check's backward passes. ``dist.all_reduce`` and a process group's own ``allreduce``
    (``dist.group.WORLD.allreduce([tensor])``) both end in ``ProcessGroup.allreduce``, which ``installed`` replaces:
    inside the participant's hook each call's dtypes are noted and it returns a ``_PendingWork``; elsewhere it is
    the real one."""

    def __init__(self):
        self.real = vars(dist.ProcessGroup)["allreduce"]
        self.lock = threading.RLock()  # completing a work: from the hook's thread or the watchdog's
        self.in_hook, self.waited_in_hook, self.stalled = False, False, False
        self.dtypes, self.buckets, self.pending, self.from_callback = [], [], [], []
        self.hook_calls, self.timer = 0, None

    @contextlib.contextmanager
    def installed(self):
        """``ProcessGroup.allreduce`` replaced for the block. (Not with in_processes.replaced: a pybind method read
        from its class is a plain function, which, set back on the class, would no longer be given the group.)"""
        def allreduce(group, tensors, *args, **kwargs):
            return self.call(group, tensors, *args, **kwargs)

        dist.ProcessGroup.allreduce = allreduce
        try:
            yield
        finally:
            dist.ProcessGroup.allreduce = self.real

    def call(self, group, tensors, *args, **kwargs):
        if not self.in_hook:
            return self.real.__func__(group, tensors, *args, **kwargs)
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        self.dtypes.extend(str(tensor.dtype).removeprefix("torch.") for tensor in tensors)
        self.disarm()  # the time this call waits for the other rank is not the hook's
        sums = [tensor.clone() for tensor in tensors]
        self.real.__func__(group, sums, *args, **kwargs).wait()  # the real all_reduce, now, on copies
        work = _PendingWork(self, tensors, sums)
        with self.lock:
            self.pending.append(work)
        if self.stalled:  # this hook was seen waiting already: no need to see it again
            work.complete(waited=True)
        else:
            self.arm()
        return work

    def arm(self):
        """Start the watchdog: the clock of the hook's own time since its last all_reduce call returned."""
        self.disarm()
        self.timer = threading.Timer(HOOK_STALL_SECONDS, self.stall, args=(self.hook_calls,))
        self.timer.daemon = True
        self.timer.start()

    def disarm(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def stall(self, hook_call):
        """The hook is still running HOOK_STALL_SECONDS after its all_reduce call returned: it waits for the sum
        by a route the stand-in does not see. Its all_reduces complete now, as a real run's would have by then."""
        with self.lock:
            if self.in_hook and hook_call == self.hook_calls:
                self.stalled = True
                self.complete_pending(waited=True)

    def complete_pending(self, waited=False):
        """The all_reduces the hook started and did not wait for complete now."""
        with self.lock:
            pending, self.pending = self.pending, []
            for work in pending:
                work.complete(waited)

    def observe(self, hook, problems):
        """``hook`` as DDP is to call it. Its errors, and a result DDP could not use (a future that would never
        complete, say), go to ``problems``, and DDP gets the bucket unchanged: backward always ends."""
        def observed_hook(state, bucket):
            buffer = bucket.buffer()
            self.buckets.append(buffer.numel())
            with self.lock:
                self.hook_calls += 1
                self.in_hook = True
            try:
                returned = hook(state, bucket)
            except Exception as error:  # noqa: BLE001 (reported after backward, as the worker reports any error)
                returned = error
            finally:
                self.disarm()
                with self.lock:
                    self.in_hook = False
                    self.complete_pending()  # just after the hook has returned
            self.from_callback.append(isinstance(returned, _PendingFuture) and returned.from_then)
            if isinstance(returned, Exception):
                problems.append(returned)
            elif not problems and usable_future(returned, buffer, problems):
                return returned
            unchanged = torch.futures.Future()
            unchanged.set_result(buffer)
            return unchanged
        return observed_hook


def usable_future(returned, buffer, problems):
    """Whether DDP can use what the hook returned: a completed future of one tensor shaped like the bucket (the
    docstring of register_comm_hook: "the future's return type must be a single tensor")."""
    if not isinstance(returned, torch._C.Future):  # what then() returns is a torch._C.Future only
        problems.append(f"your hook returned {type(returned).__name__}: return a torch.futures.Future, e.g. the "
                        "one `.then(...)` makes from the all_reduce's `work.get_future()`")
        return False
    if not returned.done():
        problems.append("the future your hook returned never completes: return one made from the all_reduce's "
                        "future (`work.get_future().then(...)`)")
        return False
    try:
        value = returned.wait()
    except Exception as error:  # noqa: BLE001 (an error in the participant's callback)
        problems.append(error)
        return False
    if isinstance(value, (list, tuple)):  # DDP itself fails with "Unable to cast [tensor(...)] ..."
        problems.append(f"your future's value is a {type(value).__name__}, as a Work's future's is ([tensor]): DDP "
                        "needs a single tensor; return work.get_future().then(callback), in which the sum is "
                        "f.value()[0]")
        return False
    if not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
        shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
        problems.append(f"your future holds {type(value).__name__}{shape}: DDP needs one tensor shaped like "
                        f"bucket.buffer(), {tuple(buffer.shape)}")
        return False
    return True


def bf16_hook_in_rank(answer, work):
    """In each of 2 processes: a DDP Net with small buckets and the participant's hook; two backward passes, each
    rank on its own images (DDP puts every gradient in one bucket for the first, and rebuilds its buckets after
    it). The gradients must be the ranks' average to bfloat16 rounding, sent in bfloat16 by all_reduces the hook
    started without waiting for them. Each call builds its own DDP model."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert world_size == 2, "this check runs in 2 processes"
    torch.manual_seed(0)
    model = DistributedDataParallel(models.Net(dropout=False), bucket_cap_mb=HOOK_BUCKET_MB)
    torch.manual_seed(0)
    reference = models.Net(dropout=False)  # the same weights, for each rank's gradient alone
    watch, problems, steps = _WatchedAllReduce(), [], []
    model.register_comm_hook(None, watch.observe(answer.average_in_bf16, problems))
    with watch.installed():
        for step in range(2):
            generator = torch.Generator().manual_seed(100 + step)
            images = torch.randn(world_size * HOOK_SHARD, 1, 28, 28, generator=generator)
            labels = torch.randint(10, (world_size * HOOK_SHARD,), generator=generator)
            shards = list(zip(images.split(HOOK_SHARD), labels.split(HOOK_SHARD)))
            before = len(watch.buckets)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(shards[rank][0]), shards[rank][1]).backward()
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            steps.append((got, [flat_gradient(reference, *shard) for shard in shards], watch.buckets[before:]))
    # Every collective is done: from here on each rank judges its own gradients, whatever the other finds.
    for problem in problems:
        if isinstance(problem, _ReadTooEarly):
            raise in_processes.Wrong(f"rank {rank}: {READ_TOO_EARLY}")
        raise in_processes.Wrong(f"rank {rank}: {problem}") if isinstance(problem, str) else problem
    if not watch.dtypes:
        raise in_processes.Wrong(f"rank {rank}: your hook started no all_reduce: call dist.all_reduce on the "
                                 "bucket's gradients (bucket.buffer()), cast to torch.bfloat16")
    dtypes = sorted(set(watch.dtypes))
    if "float16" in dtypes:
        # float16's smallest normal number is 2^-14 (6.1e-5): below it digits go, and below 2^-25 (3e-8) all of
        # them. bfloat16 has float32's 8 exponent bits: its smallest normal is float32's, 1.2e-38.
        raise in_processes.Wrong(f"rank {rank}: your all_reduce sent float16: the exercise asks for bfloat16. Both "
                                 "halve float32's bytes, but float16's range is narrow (smallest normal number "
                                 "6.1e-05): small gradients lose digits or become 0; bfloat16 keeps float32's range")
    if dtypes != ["bfloat16"]:
        raise in_processes.Wrong(f"rank {rank}: your all_reduce sent {', '.join(dtypes)}: no compression; send "
                                 "bucket.buffer().to(torch.bfloat16), half the bytes of float32")
    for got, (a, b), _ in steps:
        check_average(got, a, b, rank, in_callback=all(watch.from_callback))
    if watch.waited_in_hook:
        raise in_processes.Wrong(f"rank {rank}: {WAITS}")
    got, (a, b), _ = steps[-1]
    return {"buckets": [numels for _, _, numels in steps],
            "largest_difference": (got - (a + b) / 2).abs().max().item(),
            "largest_gradient": torch.maximum(a.abs(), b.abs()).max().item()}


def check_average(got, a, b, rank, in_callback):
    """``got`` must be (a + b) / 2 to bfloat16 rounding; else name the mistake it matches. ``in_callback``: every
    future the hook returned came from ``then`` on its all_reduce's, so its value was computed after the sum."""
    # The right answer rounds a and b to bf16 (each moves by at most 2^-8 of itself), sums them and rounds the sum
    # to bf16 (at most 2^-8 of |sum| <= (1 + 2^-8)(|a| + |b|)), then halves (exact): at most 2^-8 (|a| + |b|)
    # (1 + 2^-8 + 2^-16) from the float32 average; the float32 steps add ~2^-24. 1% covers it all. (On gloo a
    # right hook gives bf16(bf16(a) + bf16(b)) / 2 to the bit, up to 0.95 of this bound: checked. The bound, not
    # that value, lets any right order of casts and division pass.)
    tolerance = BF16_ROUNDING * (a.abs() + b.abs()) * 1.01
    own = (a, b)[rank]
    if within(got, (a + b) / 2, tolerance):
        return
    if within(got, a + b, 2 * tolerance):
        hint = "the gradients are the ranks' sum, twice the average: divide by the world size"
    elif (within(got, own / 2, tolerance) or within(got, own, 2 * tolerance)) and in_callback:
        hint = ("your callback returned this rank's own gradients: the all_reduce summed the bf16 copy it was "
                "given, not bucket.buffer(); take the sum from the future's value, f.value()[0]")
    elif within(got, own / 2, tolerance) or within(got, own, 2 * tolerance):
        hint = ("these are this rank's own gradients: your future's value was computed before its all_reduce "
                "completed; compute it in a callback, work.get_future().then(callback), run once the sum is there")
    else:
        hint = "these are not the ranks' average gradients"
    worst = ((got - (a + b) / 2).abs() - tolerance).argmax()
    raise in_processes.Wrong(f"rank {rank}: {hint} (e.g. {got[worst]:.3e} where the average is "
                             f"{((a + b) / 2)[worst]:.3e})")


def within(got, expected, tolerance):
    return bool(((got - expected).abs() <= tolerance).all())


@exercise(1, answers=("average_in_bf16",), rank_check=bf16_hook_in_rank)
def check_bf16_hook(average_in_bf16):
    detail = in_processes.run_check(bf16_hook_in_rank, average_in_bf16=average_in_bf16)
    first, second = detail["buckets"]
    return (f"In 2 processes, with bucket_cap_mb={HOOK_BUCKET_MB} (small, for several buckets), DDP called your "
            f"hook for {len(first)} bucket in the first backward and for {len(second)} in the second "
            f"({', '.join(f'{n:,}' for n in second)} numbers: DDP rebuilds its buckets after the first backward). "
            "Each call started a bfloat16 all_reduce and returned without waiting, so backward goes on while the "
            "bucket is sent, in half float32's bytes. The averages are float32's to bf16 rounding: off by at most "
            f"{detail['largest_difference']:.1e}, for gradients up to {detail['largest_gradient']:.1e}. torch's "
            "own version is bf16_compress_hook, in torch.distributed.algorithms.ddp_comm_hooks.default_hooks.")
