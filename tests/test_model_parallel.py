"""DDP combined with model parallelism (as the official DDP tutorial shows it): one replica over two devices.

On a CPU both halves sit on the CPU, so the split changes where layers would sit and
nothing of what trains: the run must end with step4_ddp.py's weights, bit for bit. The
GPU placement and its guard are checked without a GPU, through the function that picks
each process's two devices.
"""
import datetime

import pytest
import torch

from helpers import assert_ok, assert_one_line_error, read_json, run_outputs, run_python, run_torchrun, saved_weights
from kit import more_models
from kit.errors import CourseError
from lesson import model_parallel
from lesson.process import Runtime

# 2 epochs of 2 steps on synthetic CIFAR-shaped images, a checkpoint every 3 steps and at each epoch end: steps 2,
# 3 and 4. A run stopped after step 4, before its epoch's end, resumes mid-epoch from step 3 and trains step 4 again.
RUN = ("--dataset", "synthetic-cifar10", "--model", "resnet18", "--epochs", 2, "--max-steps", 2,
       "--batch-size", 8, "--checkpoint-every", 3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The model-parallel script and step4_ddp.py, the same run, 2 processes each."""
    folder = tmp_path_factory.mktemp("model-parallel")
    split = run_torchrun("step6_model_parallel.py", *RUN, *run_outputs(folder, "split"))
    assert_ok(split)
    assert_ok(run_torchrun("step4_ddp.py", *RUN, *run_outputs(folder, "ddp")))
    return {"folder": folder, "stdout": split.stdout}


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
def test_each_replica_is_cut_in_two_and_trains_under_torchrun(reference):
    assert ("each replica: conv1, bn1, relu, maxpool, layer1, layer2 on cpu; layer3, layer4, avgpool, fc on cpu"
            in reference["stdout"]), reference["stdout"]
    record = read_json(reference["folder"] / "results" / "split.json")
    assert (record["script"], record["world_size"], record["model"]) == ("step6_model_parallel", 2, "resnet18")
    assert len(record["per_epoch"]) == 2


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
def test_the_saved_weights_are_a_plain_resnet18s_and_equal_train_ddps(reference):
    split, ddp = saved_weights(reference["folder"], "split"), saved_weights(reference["folder"], "ddp")
    more_models.resnet18().load_state_dict(split)  # strict: the same names as the one-device model
    different = [name for name in ddp if not torch.equal(split[name], ddp[name])]
    assert split.keys() == ddp.keys() and not different, different[:5]


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
def test_a_stopped_run_resumes_from_its_checkpoint_to_the_same_weights(reference, tmp_path):
    stopped = run_torchrun("step6_model_parallel.py", *RUN, *run_outputs(tmp_path, "stopped"),
                           "--fault", "exit", "--fault-step", 4)
    assert stopped.returncode != 0
    resumed = run_torchrun("step6_model_parallel.py", *RUN, *run_outputs(tmp_path, "stopped"), "--resume")
    assert_ok(resumed)
    assert "checkpoint-00000003.pt: epoch 2, 1 of" in resumed.stdout, resumed.stdout
    split, again = saved_weights(reference["folder"], "split"), saved_weights(tmp_path, "stopped")
    assert all(torch.equal(split[name], again[name]) for name in split)


@pytest.mark.slow
def test_a_model_that_is_not_a_resnet_is_refused_in_one_line(tmp_path):
    """A world of one (python): each rank checks its own --model and raises the same line, whatever the world."""
    done = run_python("step6_model_parallel.py", "--dataset", "mnist5k", "--model", "net",
                      "--checkpoint-dir", tmp_path)
    assert_one_line_error(done, "cuts a ResNet in two")


# ---------------------------------------------------------------- devices, without a GPU

def runtime(local_rank, local_world_size, device="cuda"):
    return Runtime(rank=local_rank, local_rank=local_rank, world_size=local_world_size,
                   local_world_size=local_world_size,
                   device=torch.device(device, local_rank if device == "cuda" else None),
                   backend="nccl", threads=1, timeout=datetime.timedelta(seconds=60))


@pytest.mark.parametrize("local_rank", [0, 1])
def test_process_k_takes_gpus_2k_and_2k_plus_1(monkeypatch, local_rank):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    first, second = model_parallel.replica_devices(runtime(local_rank, 2))
    assert (first, second) == (torch.device("cuda", 2 * local_rank), torch.device("cuda", 2 * local_rank + 1))


@pytest.mark.parametrize("gpus, fix", [(3, "--nproc-per-node=1"), (1, "--device cpu"), (0, "--device cpu")])
def test_fewer_than_two_gpus_per_process_is_a_one_line_error_naming_the_fix(monkeypatch, gpus, fix):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(CourseError) as error:
        model_parallel.replica_devices(runtime(0, 2))
    message = str(error.value)
    assert "\n" not in message and f"need 4 GPUs and it has {gpus}" in message and fix in message


def test_on_a_cpu_both_halves_sit_on_the_cpu():
    assert model_parallel.replica_devices(runtime(0, 2, device="cpu")) == (torch.device("cpu"), torch.device("cpu"))


def test_the_two_device_model_computes_what_the_plain_one_does():
    torch.manual_seed(0)
    plain = more_models.resnet18().eval()
    split = model_parallel.TwoDeviceResNet(plain, torch.device("cpu"), torch.device("cpu")).eval()
    images = torch.randn(2, 3, 32, 32)
    assert torch.equal(split(images), plain(images))
    assert split.state_dict().keys() == plain.state_dict().keys()


def test_the_replica_is_on_the_devices_it_was_given():
    """Meta tensors stand in for a second device: the layers must follow the split."""
    split = model_parallel.TwoDeviceResNet(more_models.resnet18(), torch.device("cpu"), torch.device("meta"))
    devices = {name: next(getattr(split, name).parameters()).device.type
               for name in ("conv1", "layer2", "layer3", "fc")}
    assert devices == {"conv1": "cpu", "layer2": "cpu", "layer3": "meta", "fc": "meta"}
