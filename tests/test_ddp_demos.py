"""scripts/demos/ddp_mechanics.py under torchrun (2 gloo processes): each demo observes what the
notebook 04_ddp says DDP does, and the script frees its process group before its ranks exit (the gloo
threads each rank still has then, counted by the exit hook of tests/gloo_exit_hook.py). The run is made
once for the session (tests/conftest.py, ddp_mechanics_run), and test_exercises.py reads it too."""
import torch

from demos import ddp_mechanics as ddp_demos
from demos import runner
from gloo_exit_hook import COUNTS_THREADS_IN_PROC, gloo_threads_at_exit
from lesson.models import Net


def test_every_demo_prints_its_section(ddp_mechanics_run):
    output, _, _, _ = ddp_mechanics_run
    sections = runner.split_sections(output)
    assert set(ddp_demos.DEMOS) <= set(sections)
    assert all(sections[name].strip() for name in ddp_demos.DEMOS)


def test_devices_follow_the_local_rank(ddp_mechanics_run):
    _, observed, _, _ = ddp_mechanics_run
    assert [(d["rank"], d["local_rank"], d["device"]) for d in observed["devices"]] == [(0, 0, "cpu"), (1, 1, "cpu")]


def test_constructor_makes_the_weights_equal(ddp_mechanics_run):
    _, observed, _, _ = ddp_mechanics_run
    assert observed["broadcast"]["before"] > 0.01
    assert observed["broadcast"]["after"] == 0.0


def test_buckets_are_rebuilt_after_the_first_step(ddp_mechanics_run):
    _, observed, _, _ = ddp_mechanics_run
    buckets = observed["buckets"]
    sizes = buckets["parameter_numels"]
    assert buckets["bucket_numels"][0] == [sum(sizes.values())]  # step 1: one bucket
    assert buckets["bucket_numels"][1] == [
        sum(sizes[n] for n in ("fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight")),
        sum(sizes[n] for n in ("conv2.weight", "conv2.bias", "conv1.weight", "conv1.bias"))]
    step2 = buckets["steps"][1]
    first_allreduce = next(i for i, event in enumerate(step2) if "all_reduce" in event)
    last_gradient = max(i for i, event in enumerate(step2) if "gradient ready" in event)
    assert first_allreduce < last_gradient  # communication starts while backward still runs
    assert buckets["gradient_spread"] == 0.0
    assert buckets["explicit_cap_25_numels"] == [sum(sizes.values())]  # an explicit cap replaces the 1 MiB first one


def test_buffers_are_broadcast_at_each_forward(ddp_mechanics_run):
    _, observed, _, _ = ddp_mechanics_run
    assert observed["buffers"]["forward_sync_buffers=True"] == [0.0, 0.0]
    without = observed["buffers"]["forward_sync_buffers=False"]
    assert without[0] == 0.0 and without[1] > 0.01


def test_unused_parameter_fails_on_the_next_step_until_found(ddp_mechanics_run):
    _, observed, _, _ = ddp_mechanics_run
    unused = observed["unused"]
    assert unused["default_steps"] == 1
    assert "find_unused_parameters=True" in unused["error"]
    assert unused["unused"] == ["head_b.weight", "head_b.bias"]
    assert unused["fixed_steps"] == 3 and unused["fixed_error"] is None
    spread = unused["gradient_spread_after_step1"]  # step 1 averaged nothing; the control averaged
    assert spread["find_unused_parameters=False"] > 0.1 and spread["find_unused_parameters=True"] == 0.0, spread


def test_module_prefix(ddp_mechanics_run):
    _, observed, prefixed, _ = ddp_mechanics_run
    prefix = observed["prefix"]
    assert all(key.startswith("module.") for key in prefix["wrapped_keys"])
    assert prefix["wrong"].startswith("RuntimeError: Error(s) in loading state_dict for Net")
    assert prefix["right"] == prefix["stripped"] == "<All keys matched successfully>"
    state = torch.load(prefixed, map_location="cpu", weights_only=True)
    assert all(key.startswith("module.") for key in state)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "module.")
    Net(dropout=False).load_state_dict(state)


@COUNTS_THREADS_IN_PROC
def test_the_demos_free_their_group(ddp_mechanics_run):
    """Every demo of one run, the unused parameter's error among them, and then no gloo thread left."""
    *_, exit_report = ddp_mechanics_run
    assert gloo_threads_at_exit(exit_report) == [(0, 0), (1, 0)]


def test_split_sections():
    text = "setup line\n== a ==\none\ntwo\n== b ==\nthree"
    assert runner.split_sections(text) == {"": "setup line", "a": "one\ntwo", "b": "three"}
