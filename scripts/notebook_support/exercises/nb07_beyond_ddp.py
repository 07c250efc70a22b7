"""The checks of 07_beyond_ddp.ipynb's exercises: the participant's DDP communication hook, which averages each
bucket in bfloat16, run in 2 processes; and ZeRO-1's optimizer state per rank, against what the demo measured.
Notebook support: a learner may skip this module.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lesson import models

from . import in_processes
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
READ_TOO_EARLY = ("your hook read its all_reduce's future before its all_reduce completed: compute the average "
                  "in a callback, work.get_future().then(callback), which runs once the sum is there")


class _ReadTooEarly(Exception):
    """The hook read the value of an all_reduce's future before the all_reduce had completed."""


class _PendingWork:
    """What ``dist.all_reduce(..., async_op=True)`` returns to the participant's hook in this check: an all_reduce
    started but not completed. It is performed (the real all_reduce, blocking) when the hook waits for it
    (``wait()`` on the work, or on its future or one chained to it) or, at the latest, just after the hook has
    returned.

    Why this stands in for the real thing: a real asynchronous all_reduce completes at some moment after it
    starts, unknown to the hook, and until the hook waits for it, its tensor may still hold this rank's own
    values (on gloo it usually does, and sometimes a mix: a race). The stand-in always takes the latest moment the
    hook cannot see, just after it has returned, so what a real run gets most of the time, the check gets every
    time. What the hook may rely on behaves as with a real Work: ``wait()`` returns once the sum is in the tensor,
    and callbacks added with ``get_future().then(...)`` run once it is, given a future whose value is
    ``[tensor]``. Every rank performs the all_reduces in the order its hook started them, the same on every rank
    (same code, same buckets), so the ranks stay in step whatever the hook does."""

    def __init__(self, watch, tensor, op, group):
        self.watch, self.tensor, self.op, self.group = watch, tensor, op, group
        self.future = _PendingFuture(self)

    def complete(self, waited=False):
        if self.future.done():
            return
        if waited and self.watch.in_hook:
            self.watch.waited_in_hook = True
        self.watch.all_reduce(self.tensor, op=self.op, group=self.group)  # the real one, blocking
        self.future.set_result([self.tensor])

    def wait(self, timeout=None):
        self.complete(waited=True)
        return True

    def get_future(self):
        return self.future

    def is_completed(self):
        return self.future.done()

    def result(self):
        return [self.tensor]


class _PendingFuture(torch.futures.Future):
    """The future of a ``_PendingWork``, or one chained to it with ``then``: waiting on it performs the all_reduce
    first (a plain future would wait forever: nothing else completes it); its value is there once it has."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def wait(self):
        self.work.complete(waited=True)
        return super().wait()

    def value(self):
        if not self.done():
            raise _ReadTooEarly()
        return super().value()

    def then(self, callback):
        chained = _PendingFuture(self.work)

        def run(future):
            try:
                chained.set_result(callback(future))
            except Exception as error:  # noqa: BLE001 (as with torch's then: the chained future holds the error)
                chained.set_exception(error)

        self.add_done_callback(run)
        return chained


class _WatchedAllReduce:
    """``dist.all_reduce`` during the check's backward passes. Inside the participant's hook it notes each call's
    dtype and async_op, and returns a ``_PendingWork`` for an asynchronous one; elsewhere it is the real one."""

    def __init__(self):
        self.all_reduce = dist.all_reduce
        self.in_hook, self.waited_in_hook, self.calls, self.buckets, self.pending = False, False, [], [], []

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not self.in_hook:
            return self.all_reduce(tensor, op=op, group=group, async_op=async_op)
        self.calls.append({"dtype": str(tensor.dtype).removeprefix("torch."), "async_op": bool(async_op)})
        if not async_op:
            return self.all_reduce(tensor, op=op, group=group)
        work = _PendingWork(self, tensor, op, group)
        self.pending.append(work)
        return work

    def complete_pending(self):
        """The all_reduces the hook started and did not wait for complete now, after it has returned."""
        pending, self.pending = self.pending, []
        for work in pending:
            work.complete()

    def observe(self, hook, problems):
        """``hook`` as DDP is to call it. Its errors, and a result DDP could not use (a future that would never
        complete, say), go to ``problems``, and DDP gets the bucket unchanged: backward always ends."""
        def observed_hook(state, bucket):
            buffer = bucket.buffer()
            self.buckets.append(buffer.numel())
            self.in_hook = True
            try:
                returned = hook(state, bucket)
            except Exception as error:  # noqa: BLE001 (reported after backward, as the worker reports any error)
                returned = error
            finally:
                self.in_hook = False
                self.complete_pending()
            if isinstance(returned, Exception):
                problems.append(returned)
            elif not problems and usable_future(returned, buffer, problems):
                return returned
            unchanged = torch.futures.Future()
            unchanged.set_result(buffer)
            return unchanged
        return observed_hook


def usable_future(returned, buffer, problems):
    """Whether DDP can use what the hook returned: a completed future of one tensor shaped like the bucket."""
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
    value = value[0] if isinstance(value, (list, tuple)) and value else value  # DDP takes a list's first tensor
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
    with in_processes.replaced(answer, {(dist, "all_reduce"): watch}):
        for step in range(2):
            generator = torch.Generator().manual_seed(100 + step)
            images = torch.randn(world_size * HOOK_SHARD, 1, 28, 28, generator=generator)
            labels = torch.randint(10, (world_size * HOOK_SHARD,), generator=generator)
            shards = list(zip(images.split(HOOK_SHARD), labels.split(HOOK_SHARD)))
            before = len(watch.buckets)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(shards[rank][0]), shards[rank][1]).backward()
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            steps.append((got, [gradient(reference, *shard) for shard in shards], watch.buckets[before:]))
    # Every collective is done: from here on each rank judges its own gradients, whatever the other finds.
    for problem in problems:
        if isinstance(problem, _ReadTooEarly):
            raise AssertionError(f"rank {rank}: {READ_TOO_EARLY}")
        raise AssertionError(f"rank {rank}: {problem}") if isinstance(problem, str) else problem
    if not watch.calls:
        raise AssertionError(f"rank {rank}: your hook started no all_reduce: call dist.all_reduce on the bucket's "
                             "gradients (bucket.buffer()), cast to torch.bfloat16")
    for got, (a, b), _ in steps:
        check_average(got, a, b, rank)
    dtypes = sorted({call["dtype"] for call in watch.calls})
    if dtypes != ["bfloat16"]:
        raise AssertionError(f"rank {rank}: your all_reduce sent {', '.join(dtypes)}: no compression; send "
                             "bucket.buffer().to(torch.bfloat16), half the bytes of float32")
    if watch.waited_in_hook or not all(call["async_op"] for call in watch.calls):
        raise AssertionError(f"rank {rank}: your hook waits for its all_reduce (async_op=False, or a wait() inside "
                             "the hook): backward stalls at every bucket; start it with async_op=True and return "
                             "work.get_future().then(...), which DDP waits on at the end of backward")
    got, (a, b), _ = steps[-1]
    return {"buckets": [numels for _, _, numels in steps],
            "largest_difference": (got - (a + b) / 2).abs().max().item(),
            "largest_gradient": torch.maximum(a.abs(), b.abs()).max().item()}


def check_average(got, a, b, rank):
    """``got`` must be (a + b) / 2 to bfloat16 rounding; else name the mistake it matches."""
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
    elif within(got, own / 2, tolerance) or within(got, own, 2 * tolerance):
        hint = ("these are this rank's own gradients: your future's value was computed before its all_reduce "
                "completed; compute it in a callback, work.get_future().then(callback), run once the sum is there")
    else:
        hint = "these are not the ranks' average gradients"
    worst = ((got - (a + b) / 2).abs() - tolerance).argmax()
    raise AssertionError(f"rank {rank}: {hint} (e.g. {got[worst]:.3e} where the average is "
                         f"{((a + b) / 2)[worst]:.3e})")


def gradient(model, images, labels):
    model.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def within(got, expected, tolerance):
    return bool(((got - expected).abs() <= tolerance).all())


@exercise(1, answers=("average_in_bf16",), rank_check=bf16_hook_in_rank)
def check_bf16_hook(average_in_bf16):
    detail = in_processes.run_check(bf16_hook_in_rank, average_in_bf16=average_in_bf16)
    first, second = detail["buckets"]
    return (f"In 2 processes, DDP called your hook for {len(first)} bucket in the first backward and for "
            f"{len(second)} in the second ({', '.join(f'{n:,}' for n in second)} numbers: DDP rebuilds its buckets "
            "after the first backward). Each call started a bfloat16 all_reduce and returned without waiting, so "
            "backward goes on while the bucket is sent, in half float32's bytes. The averages are float32's to "
            f"bf16 rounding: off by at most {detail['largest_difference']:.1e}, for gradients up to "
            f"{detail['largest_gradient']:.1e}. torch's own version is bf16_compress_hook, in "
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.")
