"""The checks of the notebooks' exercises. Notebook support: a learner may skip this module.

Every exercise in the notebooks has three cells: one where the participant writes the
answer (it starts as a placeholder, ``...``), one that can load the solution from
``notebooks/solutions/`` (a commented ``%load`` line, so nothing shows before it is asked
for), and a check cell that calls one of the functions below on the participant's names:

- a placeholder left as it is prints "not attempted yet", and the notebook runs on;
- a wrong answer raises AssertionError with a hint that does not give the answer away;
- a right answer prints "correct" and what the result teaches.

A check returns nothing: its printed line is the verdict, and the cell shows only that line.

The checks compare with the real thing wherever they can (DistributedSampler, PyTorch's
FLOP counter, a torchrun of the collectives demo, what DDP did), not with a stored answer.
``EXERCISES`` lists them all, for the tests.
"""
import functools
import inspect
import json
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

NOT_ATTEMPTED = "not attempted yet"


@dataclass(frozen=True)
class Exercise:
    notebook: str  # e.g. "01_baseline"
    number: int
    answers: tuple  # the names the participant defines
    check: callable

    @property
    def solution(self):
        """The solution file, relative to notebooks/."""
        return f"solutions/{self.notebook[:2]}_ex{self.number}.py"

    @property
    def load_line(self):
        """The line of the notebook cell that loads the solution (from notebooks/ or workspace/)."""
        return f"# %load ../notebooks/{self.solution}"


EXERCISES = {}  # "01.2" -> Exercise


def is_placeholder(value):
    """``...``, or a function whose body is only ``...`` (or ``pass``): not written yet."""
    if value is Ellipsis:
        return True
    code = getattr(value, "__code__", None)
    return code is not None and code.co_code == _empty_function.__code__.co_code and not code.co_names


def _empty_function():
    ...


def exercise(notebook, number, answers):
    """Register a check; it prints "not attempted yet" while any answer is a placeholder."""
    def register(check):
        signature = inspect.signature(check)

        @functools.wraps(check)
        def run(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            missing = [name for name in answers if is_placeholder(given[name])]
            if missing:
                print(f"Exercise {number}: {NOT_ATTEMPTED}. Write {' and '.join(f'`{m}`' for m in missing)} "
                      "in the cell above, run it, then run this check again.")
                return
            lesson = check(*args, **kwargs)
            print(f"Exercise {number}: correct. {lesson}")

        EXERCISES[f"{notebook[:2]}.{number}"] = Exercise(notebook, number, tuple(answers), run)
        return run
    return register


# --- 00_concepts ----------------------------------------------------------------------------

@exercise("00_concepts", 1, answers=("where", "crash_with_global_rank"))
def check_where(where, crash_with_global_rank, nodes=3, gpus_per_node=4):
    world = nodes * gpus_per_node
    for rank in range(world):
        node, local_rank = divmod(rank, gpus_per_node)  # torchrun fills group rank 0's node, then 1's, ...
        got = where(rank, gpus_per_node)
        assert tuple(got) == (node, local_rank, f"cuda:{local_rank}"), (
            f"where({rank}, {gpus_per_node}) returned {got!r}: check the node, the local rank and the device")
    expected = [rank for rank in range(world) if rank >= gpus_per_node]  # no node has cuda:4 or more
    assert sorted(crash_with_global_rank) == expected, (
        f"crash_with_global_rank should hold every rank whose cuda:{{rank}} does not exist on a {gpus_per_node}-GPU node")
    return (f"Rank 6 runs on node {where(6, gpus_per_node)[0]} as {where(6, gpus_per_node)[2]}; "
            f"with cuda:{{rank}}, ranks {expected[0]}-{expected[-1]} would fail with 'invalid device ordinal'.")


@functools.cache
def collectives_record(world_size):
    """What every rank of the collectives demo held, from a real torchrun with world_size processes."""
    from .runner import torchrun

    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "collectives.json"
        torchrun("demos/collectives.py", "--device", "cpu", "--backend", "gloo", "--json", record,
                 nproc=world_size, echo=False)
        return json.loads(record.read_text())


@exercise("00_concepts", 2, answers=("predict",))
def check_predict(predict, world_size=3):
    prediction = predict(world_size)
    assert set(prediction) == {"all_reduce", "all_reduce_mean", "all_gather"}, (
        f"predict({world_size}) should return a dict with the keys all_reduce, all_reduce_mean and all_gather")
    observed = collectives_record(world_size)  # the demo, run now with world_size processes
    for collective, after in prediction.items():
        assert observed[collective]["after"] == after, (
            f"{collective}: you predicted {after}, the {world_size} ranks held {observed[collective]['after']}")
    return (f"The demo ran with {world_size} processes and every rank held what you predicted "
            f"(after all_reduce: {observed['all_reduce']['after'][0]}).")


# --- 01_baseline ----------------------------------------------------------------------------

def forward_flops_per_layer():
    """PyTorch's own count of the Net's forward FLOPs for one image, per module."""
    from torch.utils.flop_counter import FlopCounterMode

    from lesson.models import Net

    counter = FlopCounterMode(display=False)
    with counter:
        Net()(torch.zeros(1, 1, 28, 28))
    return {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}


@exercise("01_baseline", 1, answers=("conv2_flops", "fc1_flops"))
def check_flops(conv2_flops, fc1_flops):
    counted = forward_flops_per_layer()
    assert conv2_flops == counted["Net.conv2"], f"conv2_flops = {conv2_flops:,} is not what PyTorch counts for conv2"
    assert fc1_flops == counted["Net.fc1"], f"fc1_flops = {fc1_flops:,} is not what PyTorch counts for fc1"
    return (f"conv2: {conv2_flops:,} FLOP, fc1: {fc1_flops:,} FLOP per image, forward, as PyTorch counts them. "
            "fc1 holds almost all the parameters but conv2 does most of the work: a convolution uses each "
            "of its weights at every one of its 24 x 24 output positions, a linear layer uses each weight once.")


@exercise("01_baseline", 2, answers=("repeated",))
def check_padding(repeated, test_images=10_000, world_sizes=range(1, 9)):
    assert sorted(repeated) == list(world_sizes), f"repeated needs one entry for each world size {list(world_sizes)}"
    for world_size in world_sizes:
        per_rank = len(DistributedSampler(range(test_images), num_replicas=world_size, rank=0, shuffle=False))
        assert repeated[world_size] == per_rank * world_size - test_images, (
            f"world size {world_size}: DistributedSampler repeats a different number of images than {repeated[world_size]}")
    padded = {w: n for w, n in repeated.items() if n}
    return f"World sizes that pad {test_images:,} test images, and by how many: {padded}."


# --- 02_allreduce_by_hand -------------------------------------------------------------------

SHARD_CASES = [(4000, 2, 0, 1), (4000, 2, 0, 2), (1000, 3, 7, 5), (10, 4, 0, 0)]  # n, world size, seed, epoch


@exercise("02_allreduce_by_hand", 1, answers=("shard",))
def check_shard(shard):
    for n, world_size, seed, epoch in SHARD_CASES:
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)
            sampler.set_epoch(epoch)
            got = list(shard(n, world_size, rank, seed, epoch))
            assert got == list(sampler), (
                f"shard({n}, {world_size}, {rank}, {seed}, {epoch}) differs from DistributedSampler's indices"
                + (f" in length ({len(got)} against {len(sampler)})" if len(got) != len(sampler) else ""))
    return "shard() gives DistributedSampler's indices, padding included: no communication needed."


@exercise("02_allreduce_by_hand", 2, answers=("overlap", "never_seen"))
def check_seed_per_rank(overlap, never_seen, images=4000):
    rank0 = set(DistributedSampler(range(images), num_replicas=2, rank=0, seed=0))
    rank1 = set(DistributedSampler(range(images), num_replicas=2, rank=1, seed=1))
    assert overlap == len(rank0 & rank1), f"overlap = {overlap} is not the number of images on both ranks"
    assert never_seen == images - len(rank0 | rank1), f"never_seen = {never_seen} is not the number on neither rank"
    return (f"{overlap:,} of the {images:,} images are on both ranks and {never_seen:,} on neither: every "
            "duplicate leaves one image out. Nothing fails and the loss still goes down, which is what makes "
            "this bug expensive: each epoch trains on about three quarters of the data. Give every rank the same "
            "sampler seed; different seeds only for what should differ, such as dropout masks.")


@exercise("02_allreduce_by_hand", 3, answers=("plain", "weighted"))
def check_weighted_mean(plain, weighted, gradient, images, labels, split=40):
    whole = gradient(images, labels)
    first, second = gradient(images[:split], labels[:split]), gradient(images[split:], labels[split:])
    n = len(labels)
    assert torch.allclose(plain, (first + second) / 2, atol=1e-7), "plain should be the mean of the two shard gradients"
    assert torch.allclose(weighted, (split * first + (n - split) * second) / n, atol=1e-7), (
        "weighted should weight each shard's gradient by its number of images")
    error_plain, error_weighted = (plain - whole).abs().max().item(), (weighted - whole).abs().max().item()
    assert error_weighted < 1e-6 < 1e-3 < error_plain, (error_plain, error_weighted)
    return ("Weighted by shard size, the mean is the whole batch's gradient (within 1e-6); the plain mean is off "
            "by more than 1e-3. all_reduce followed by a division by the world size is the plain mean, so every "
            "rank must bring a batch of the same size.")


# --- 03_data_parallel -----------------------------------------------------------------------

@exercise("03_data_parallel", 1, answers=("sizes_100_on_3", "gpus_working_2_on_4"))
def check_scatter(sizes_100_on_3, gpus_working_2_on_4):
    # DataParallel's scatter cuts the batch with Tensor.chunk (torch/csrc/cuda/comm.cpp, scatter()).
    expected = [len(chunk) for chunk in torch.arange(100).chunk(3)]
    assert list(sizes_100_on_3) == expected, f"{list(sizes_100_on_3)} is not how chunk() cuts 100 samples in 3"
    working = len(torch.arange(2).chunk(4))
    assert gpus_working_2_on_4 == working, f"{gpus_working_2_on_4} GPUs is not how many get a piece of 2 samples"
    return (f"100 samples on 3 GPUs: {expected} (chunk() makes pieces of ceil(100 / 3) = 34 and the last gets "
            f"what is left); 2 samples on 4 GPUs: {working} GPUs work, {4 - working} wait.")


@exercise("03_data_parallel", 2, answers=("per_step", "per_epoch"))
def check_replicate_traffic(per_step, per_epoch, gpus=4, images=60_000, batch_per_gpu=64):
    from lesson.models import Net

    model_bytes = sum(p.numel() * p.element_size() for p in Net().parameters())
    steps = math.ceil(images / (batch_per_gpu * gpus))
    assert per_step == model_bytes * (gpus - 1), (
        f"per_step = {per_step:,} bytes: count one float32 copy of the Net for every GPU that needs one")
    assert per_epoch == per_step * steps, f"per_epoch = {per_epoch:,}: how many steps does one epoch take?"
    return (f"{per_step / 1e6:.1f} MB of weights reach GPUs 1-{gpus - 1} every step, {per_epoch / 1e9:.2f} GB "
            f"per epoch of {steps} steps. With NCCL's ring broadcast, GPU 0 itself sends about one copy "
            f"({model_bytes / 1e6:.1f} MB) to its neighbour, which keeps it and passes it on: every link carries "
            "about one copy per step. In backward, the replicas' gradients are summed onto GPU 0, along a ring "
            "too. In DDP the weights never move: each process sends about 2 x (N - 1) / N copies of the "
            "gradients per step, all processes at once, and mostly while backward is still running (notebook 04).")


# --- 04_ddp ---------------------------------------------------------------------------------

@exercise("04_ddp", 1, answers=("rescued",))
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


@exercise("04_ddp", 2, answers=("predict_buckets",))
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


@exercise("04_ddp", 3, answers=("steps_per_epoch",))
def check_steps_per_epoch(steps_per_epoch, images=60_000, global_batch=64):
    lines = []
    for gpus in (1, 2, 4, 8):
        for batch in (global_batch // gpus, global_batch):
            shard = len(DistributedSampler(range(images), num_replicas=gpus, rank=0))
            expected = math.ceil(shard / batch)  # the last, shorter batch is a step too
            got = steps_per_epoch(gpus, batch, images)
            assert got == expected, f"steps_per_epoch({gpus}, {batch}, {images}) = {got}: not what each rank does"
        lines.append(f"{gpus} GPU(s): {steps_per_epoch(gpus, global_batch // gpus, images)} steps of "
                     f"{global_batch // gpus}, or {steps_per_epoch(gpus, global_batch, images)} of {global_batch}")
    return ("Per rank and epoch: " + "; ".join(lines) + ". With a fixed global batch every rank takes as many "
            "steps as one GPU did, each on fewer images.")


# --- 05_checkpoints_and_faults --------------------------------------------------------------

# (--checkpoint-every, steps per epoch, the step after which a rank dies): the checkpoint a restart resumes from
RESUME_CASES = [(4, 6, 10), (4, 6, 7), (4, 6, 8), (5, 3, 4), (100, 50, 149), (3, 10, 2)]


def newest_checkpoint_step(checkpoint_every, steps_per_epoch, fault_step):
    """What the Trainer does: a checkpoint every N global steps and one at each epoch's end;
    a fault drill strikes after the step's checkpoint. 0: none yet, a fresh start."""
    saved = [step for step in range(1, fault_step + 1)
             if step % checkpoint_every == 0 or step % steps_per_epoch == 0]
    return max(saved, default=0)


@exercise("05_checkpoints_and_faults", 1, answers=("resume_step",))
def check_resume_step(resume_step, observed=None):
    for case in RESUME_CASES:
        expected = newest_checkpoint_step(*case)
        got = resume_step(*case)
        assert got == expected, (f"resume_step{case} = {got}: which checkpoints exist after step {case[2]}? "
                                 "Count those every N steps and those at the end of each epoch")
    if observed is not None:  # the run the notebook killed: what its restarted group printed
        case = (observed["checkpoint_every"], observed["steps_per_epoch"], observed["fault_step"])
        assert resume_step(*case) == observed["resumed_step"], (
            f"the killed run resumed from step {observed['resumed_step']}, you predict {resume_step(*case)}")
    every, per_epoch, fault = RESUME_CASES[0]
    redone = fault - newest_checkpoint_step(every, per_epoch, fault)
    return (f"With a checkpoint every {every} steps and {per_epoch} steps per epoch, a rank lost after step {fault} "
            f"costs {redone} step(s) of work on every rank. --checkpoint-every trades that against the time "
            "spent writing checkpoints.")


# --- 06_real_models ------------------------------------------------------------------------

def ddp_bytes_per_step(model):
    """What DDP hands to its collectives in one training step of ``model`` (CIFAR-shaped inputs), in a world of
    one process made for the count if there is none, in bytes: the gradients it all-reduces, counted by a
    communication hook, and the buffers it broadcasts from rank 0 once a training step (before a forward that
    follows a training forward, or the first), counted where DDP makes that call (``_pre_forward`` ->
    ``_sync_buffers`` -> ``_distributed_broadcast_coalesced`` in torch/nn/parallel/distributed.py), which the
    gradient hook of ``register_comm_hook`` does not see. Which tensors these are depends on the model and its
    requires_grad flags, not on how many processes there are."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    own_group = not dist.is_initialized()
    if own_group:  # a world of one needs no port: an in-process store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sent = {"gradients all-reduced": 0, "buffers broadcast": 0}

        def count_then_allreduce(state, bucket):
            sent["gradients all-reduced"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        wrapped = DDP(model)  # its constructor broadcasts every parameter and buffer once: not a step's traffic
        wrapped.register_comm_hook(None, count_then_allreduce)
        broadcast = wrapped._distributed_broadcast_coalesced

        def count_then_broadcast(tensors, *args):
            sent["buffers broadcast"] += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            return broadcast(tensors, *args)

        wrapped._distributed_broadcast_coalesced = count_then_broadcast
        wrapped(torch.randn(2, 3, 32, 32)).sum().backward()
        return sent
    finally:
        if own_group:
            dist.destroy_process_group()


def _cifar_resnet_training(*prefixes):
    """ResNet-18 for CIFAR-10's 10 classes; only the parameters under ``prefixes`` train."""
    from kit.more_models import resnet18

    model = resnet18(num_classes=10)
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(prefixes)
    return model


@exercise("06_real_models", 1, answers=("head_bytes", "layer4_and_head_bytes", "buffer_bytes"))
def check_finetune_bytes(head_bytes, layer4_and_head_bytes, buffer_bytes):
    head = ddp_bytes_per_step(_cifar_resnet_training("fc."))
    assert head_bytes == head["gradients all-reduced"], (
        f"head_bytes = {head_bytes:,}: the head of a 10-class ResNet-18 has a weight and a bias; how many values, "
        "and how many bytes each?")
    both = ddp_bytes_per_step(_cifar_resnet_training("fc.", "layer4."))
    assert layer4_and_head_bytes == both["gradients all-reduced"], (
        f"layer4_and_head_bytes = {layer4_and_head_bytes:,} is not what DDP all-reduced: DDP reduces the gradients "
        "of the parameters that train; does everything in layer4's state_dict have a gradient?")
    assert buffer_bytes == head["buffers broadcast"], (
        f"buffer_bytes = {buffer_bytes:,} is not what DDP broadcast: it copies every buffer of the model from rank 0 "
        "before each training forward, whatever trains; which buffers does a BatchNorm layer hold, and of which dtype?")
    everything = ddp_bytes_per_step(_cifar_resnet_training(""))
    total = {name: sum(sent.values()) for name, sent in (("head", head), ("all", everything))}
    return (f"Per training step DDP all-reduced {head['gradients all-reduced']:,} bytes of gradients with the head "
            f"alone, {both['gradients all-reduced']:,} with layer4 too, {everything['gradients all-reduced']:,} with "
            f"every layer, and broadcast the same {buffer_bytes:,} bytes of BatchNorm buffers each time. With the "
            f"head alone that is {total['head']:,} bytes a step: {total['all'] / total['head']:,.0f} times fewer "
            f"than training every layer, not the {everything['gradients all-reduced'] / head['gradients all-reduced']:,.0f} "
            "times the gradients alone suggest.")


# (nodes, GPUs per node, processes per node): jobs of the model-parallel script
REPLICA_CASES = [(1, 4, 2), (2, 8, 4), (2, 4, 2), (3, 8, 3)]


def _replica_gpus(rank, gpus_per_node, processes_per_node, nodes):
    """What step6_model_parallel.py does for global rank ``rank``: (node, first GPU, second GPU)."""
    import datetime
    from unittest import mock

    from lesson.model_parallel import replica_devices
    from lesson.process import Runtime

    node, local_rank = divmod(rank, processes_per_node)  # the node of group rank 0 holds the first ranks
    runtime = Runtime(rank=rank, local_rank=local_rank, world_size=nodes * processes_per_node, local_world_size=processes_per_node,
                      device=torch.device("cuda", local_rank), backend="nccl", threads=1,
                      timeout=datetime.timedelta(minutes=5))
    with mock.patch.object(torch.cuda, "device_count", return_value=gpus_per_node):
        first, second = replica_devices(runtime)
    return node, first.index, second.index


@exercise("06_real_models", 2, answers=("replica_gpus",))
def check_replica_gpus(replica_gpus):
    for nodes, gpus, processes in REPLICA_CASES:
        for rank in range(nodes * processes):
            expected = _replica_gpus(rank, gpus, processes, nodes)
            got = tuple(replica_gpus(rank, gpus, processes))
            assert got == expected, (
                f"replica_gpus({rank}, {gpus}, {processes}) = {got}: on {nodes} node(s) of {gpus} GPUs with "
                f"{processes} processes each, rank {rank} runs on node {expected[0]}; which rank picks the GPUs?")
    node, first, second = _replica_gpus(5, 8, 4, nodes=2)
    return (f"On 2 nodes of 8 GPUs, rank 5 is LOCAL_RANK 1 of node {node} and takes its GPUs {first} and {second}: "
            "the GPU numbers start again on every node, so they come from the local rank. With 3 processes on an "
            "8-GPU node, GPUs 6 and 7 stay idle: launch --nproc-per-node=GPUs/2 (scripts/tools/launch.py "
            "--gpus-per-process 2 does).")


# --- 07_beyond_ddp --------------------------------------------------------------------------

@exercise("07_beyond_ddp", 1, answers=("syncs_per_step",))
def check_syncs_per_step(syncs_per_step, observed):
    k = observed["micro_batches"]
    for way, use_no_sync in (("no_sync", True), ("without no_sync", False)):
        seen = observed[way]["syncs_per_step"][-1]
        got = syncs_per_step(k, use_no_sync)
        assert got == seen, f"syncs_per_step({k}, use_no_sync={use_no_sync}) = {got}; DDP synchronised {seen} time(s)"
    for micro_batches in (1, 2, 8, 32):  # the rule, beyond the K the demo ran
        pair = (syncs_per_step(micro_batches, True), syncs_per_step(micro_batches, False))
        assert pair == (1, micro_batches), (f"for {micro_batches} micro-batches you predict {pair} (with, without "
                                            "no_sync): think about what happens in each backward")
    return (f"With no_sync one sync per optimizer step, whatever K; without it one per micro-batch: {k} times the "
            "traffic, for exactly the same weights. On a slow network that is the difference between "
            "accumulation being nearly free and costing K steps' worth of communication.")


ADAM_BYTES_PER_NUMBER = 8  # exp_avg and exp_avg_sq, float32 each


@exercise("07_beyond_ddp", 2, answers=("zero_state_per_rank",))
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


# --- 08_performance -------------------------------------------------------------------------

def _ring_bus_bandwidth(algbw, ranks):
    """nccl-tests' all_reduce correction: a ring moves 2(n-1)/n of the message through each rank's link."""
    return algbw * 2 * (ranks - 1) / ranks


@exercise("08_performance", 1, answers=("bus_bandwidth",))
def check_bus_bandwidth(bus_bandwidth):
    for ranks in range(1, 9):
        expected = _ring_bus_bandwidth(10.0, ranks)
        got = bus_bandwidth(10.0, ranks)
        assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12), (
            f"bus_bandwidth(10.0, {ranks}) = {got}: count what one rank sends in a ring all_reduce "
            "(a reduce-scatter, then an all-gather, each in chunks of 1/n of the message)")
    return ("For 2 ranks busbw equals algbw; for 8 it is 1.75 x algbw. busbw is what each rank's link carries, "
            "so it can be set against the link's own bandwidth whatever the number of ranks.")


def _communication_share(batch, flops_per_sample, flops_per_second, gradient_bytes, busbw, ranks):
    compute = batch * flops_per_sample / flops_per_second
    communication = gradient_bytes * 2 * (ranks - 1) / ranks / busbw
    return communication / (compute + communication)


@exercise("08_performance", 2, answers=("communication_share",))
def check_communication_share(communication_share):
    net = dict(flops_per_sample=71.6e6, gradient_bytes=4.8e6)  # the Net: FLOPs per sample, fp32 gradients
    cases = [(32, 30e9, 1.0e9, 2), (64, 30e9, 1.0e9, 2), (32, 100e12, 200e9, 8), (32, 100e12, 20e9, 16)]
    for batch, flops_per_second, busbw, ranks in cases:
        expected = _communication_share(batch, net["flops_per_sample"], flops_per_second, net["gradient_bytes"],
                                        busbw, ranks)
        got = communication_share(batch, net["flops_per_sample"], flops_per_second, net["gradient_bytes"],
                                  busbw, ranks)
        assert math.isclose(got, expected, rel_tol=1e-6), (
            f"batch {batch}, {flops_per_second:.0e} FLOP/s, busbw {busbw:.0e} B/s, {ranks} ranks: you get {got:.3f}; "
            "compute grows with the batch, the gradient all_reduce does not (and is 2(n-1)/n of the bytes per link)")
    shares = [_communication_share(b, net["flops_per_sample"], f, net["gradient_bytes"], w, n) for b, f, w, n in cases]
    return (f"The Net on a 2-core CPU: {shares[0]:.0%} of a step is communication at batch 32, {shares[1]:.0%} at "
            f"64. On GPUs at 100 TFLOP/s the same Net spends {shares[2]:.0%} communicating over a 200 GB/s link, "
            f"{shares[3]:.0%} over a 20 GB/s network: fast compute makes a small model communication-bound.")


# --- 09_when_it_hangs ----------------------------------------------------------------------

def hung_job_evidence(name):
    """A file of notebooks/hung_jobs/: what two real hung jobs left (scripts/demos/record_hung_jobs.py made them)."""
    from kit.output_paths import REPO

    return (REPO / "notebooks" / "hung_jobs" / name).read_text()


def rank_dumps(text):
    """{rank: py-spy dump} from a file of dumps, one section per rank, each under '=== rank N: ...'."""
    parts = re.split(r"^=== rank (\d+): .*===$", text, flags=re.M)
    return {int(rank): dump for rank, dump in zip(parts[1::2], parts[2::2])}


def where_each_rank_waits(dumps):
    """{rank: (the collective, the course's frame that called it)} from each rank's py-spy dump."""
    from .rank_stacks import main_thread, waiting_collective

    return {rank: waiting_collective(main_thread(dump)) for rank, dump in dumps.items()}


@exercise("09_when_it_hangs", 1, answers=("odd_rank", "odd_line"))
def check_odd_rank(odd_rank, odd_line, dumps=None):
    from kit.output_paths import REPO

    waits = where_each_rank_waits(rank_dumps(dumps or hung_job_evidence("uneven_3_ranks.pyspy.txt")))
    places = {rank: (collective.function, caller.file, caller.line) for rank, (collective, caller) in waits.items()}
    odd = [rank for rank, place in places.items() if list(places.values()).count(place) == 1]
    assert len(odd) == 1, f"the dumps should show one rank apart from the others: {places}"
    rank, (collective, caller) = odd[0], waits[odd[0]]
    assert odd_rank == rank, (f"odd_rank = {odd_rank}: that rank waits where another one does; compare each rank's "
                              "innermost frames and find the stack no other rank shares")
    assert odd_line == caller.line, (f"odd_line = {odd_line}: in rank {rank}'s dump, take the line of the course's own "
                                     f"frame just under the torch.distributed call ({collective.function})")
    code = (REPO / "scripts" / caller.file).read_text().splitlines()[caller.line - 1].strip()
    others = sorted({f"{place[0]} at {place[1]}:{place[2]}" for other, place in places.items() if other != rank})
    return (f"Rank {rank} waits in {collective.function} at {caller.file}:{caller.line} (`{code}`), the others in "
            f"{' and '.join(others)}: its batches ran out one early, so it reached the end of the epoch while they "
            "wait for a batch it never had. No error names it: every rank just waits, in a different collective. "
            "Give every rank the same number of batches (DistributedSampler pads; drop_last), or use Join.")


@exercise("09_when_it_hangs", 2, answers=("culprit", "steps_done", "root_cause"))
def check_culprit(culprit, steps_done, root_cause, log=None):
    log = log or hung_job_evidence("uneven_4_ranks.log")
    behind = {(int(rank), int(step)) for rank, step in re.findall(r"rank (\d+) last reported step (\d+)", log)}
    assert len(behind) == 1, f"the log should name one rank behind the others: {behind}"
    (rank, step), = behind
    named = int(re.search(r"Root Cause \(first observed failure\):.*?rank\s+: (\d+)", log, re.S)[1])
    stopped = sorted(int(r) for r in re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: -15", log))
    assert culprit == rank, (f"culprit = {culprit}: read the ranks' own error lines; which rank do the others say "
                             "they waited for?")
    assert steps_done == step, f"steps_done = {steps_done}: how many steps had rank {rank} completed, by those lines?"
    assert root_cause == named, (f"root_cause = {root_cause}: which rank does torchrun's summary name under "
                                 "'Root Cause (first observed failure)'?")
    return (f"Rank {rank} stopped the job after {step} steps, yet torchrun names rank {named} as the root cause: the "
            f"first process to fail, a rank that waited for rank {rank} and gave up at --timeout. Rank(s) "
            f"{', '.join(map(str, stopped))} ended with exit code -15 (SIGTERM): torchrun stopped them. Look for the "
            "rank the others waited for, not the first one to fail.")
