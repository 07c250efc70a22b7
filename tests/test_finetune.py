"""Fine-tuning a pretrained ResNet-18 on an ImageFolder (as the SageMaker DDP tutorial does with the ants and bees),
under torchrun.

Neither the ants and bees nor torchvision's ImageNet weights can be downloaded here. The
tests write a real ImageFolder (PNG files, two classes of bundled MNIST digits) and a
weights file saved from a ResNet-18 they build (tests/data_makers.py), and check that
the run starts from exactly that file, trains what --finetune says, and validates exactly.
"""
import pytest
import torch

import step6_finetune
from data_makers import write_image_folder, write_resnet18_weights
from distributed_helpers import run_in_group
from helpers import assert_ok, assert_one_line_error, read_json, run_python, run_torchrun, script_env
from kit import datasets, more_models
from lesson import models
from machinery import finetune
from machinery.cli import parse_args

# 2 classes: 8 training images, one step of 4 per rank (a ResNet-18 step at 224 x 224 costs seconds here), and
# 8 validation images.
TRAIN_PER_CLASS, VAL_PER_CLASS = 4, 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finetune")
    return {"data_dir": write_image_folder(folder / "digits", TRAIN_PER_CLASS, VAL_PER_CLASS),
            "weights": folder / "pretrained.pt", "state": write_resnet18_weights(folder / "pretrained.pt")}


def finetune_run(files, folder, mode, *extra):
    return run_torchrun("step6_finetune.py", "--data-dir", files["data_dir"], "--weights", files["weights"],
                        "--finetune", mode, "--epochs", 1, "--batch-size", 4,
                        "--checkpoint-dir", folder / "checkpoints",
                        "--results-dir", folder, "--run-name", mode, "--save", folder / f"{mode}.pt", *extra)


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory):
    """--finetune head and --finetune all, each 2 processes, one epoch (1 step of 2 x 4 images)."""
    folder = tmp_path_factory.mktemp("runs")
    done = {mode: finetune_run(files, folder, mode) for mode in ("head", "all")}
    for result in done.values():
        assert_ok(result)
    return {mode: {"stdout": done[mode].stdout, "record": read_json(folder / f"{mode}.json"),
                   "weights": torch.load(folder / f"{mode}.pt", map_location="cpu", weights_only=True)}
            for mode in done}


def body_parameters(state):
    """The names of the trainable tensors outside the head (not BatchNorm's running statistics)."""
    names = {name for name, _ in more_models.resnet18(num_classes=2).named_parameters()}
    return [name for name in state if name in names and not name.startswith(finetune.HEAD)]


@pytest.mark.slow
def test_the_head_is_sized_to_the_class_folders(runs):
    for run in runs.values():
        assert run["weights"]["fc.weight"].shape == (2, 512) and run["weights"]["fc.bias"].shape == (2,)
        assert run["record"]["dataset"] == "imagefolder" and run["record"]["world_size"] == 2


@pytest.mark.slow
def test_with_the_head_alone_training_every_other_weight_is_the_files(runs, files):
    trained, pretrained = runs["head"]["weights"], files["state"]
    body = body_parameters(trained)
    assert len(body) == 60  # ResNet-18's convolutions and BatchNorm scales and shifts
    unchanged = [name for name in body if torch.equal(trained[name], pretrained[name])]
    assert unchanged == body
    # Frozen is not fixed: BatchNorm's running statistics still follow the new images.
    assert not torch.equal(trained["bn1.running_mean"], pretrained["bn1.running_mean"])


@pytest.mark.slow
def test_with_every_layer_training_the_body_moves_away_from_the_file(runs, files):
    trained, pretrained = runs["all"]["weights"], files["state"]
    moved = [name for name in body_parameters(trained) if not torch.equal(trained[name], pretrained[name])]
    assert len(moved) == 60


@pytest.mark.slow
def test_the_run_says_how_much_trains_and_how_many_gradient_bytes_ddp_reduces(runs):
    model = more_models.resnet18(num_classes=2)
    head = sum(p.numel() for name, p in model.named_parameters() if name.startswith(finetune.HEAD))
    total = sum(p.numel() for p in model.parameters())
    assert (f"--finetune head: {head:,} of {total:,} parameters train; DDP all-reduces {4 * head:,} bytes"
            in runs["head"]["stdout"]), runs["head"]["stdout"]
    assert (f"--finetune all: {total:,} of {total:,} parameters train; DDP all-reduces {4 * total:,} bytes"
            in runs["all"]["stdout"]), runs["all"]["stdout"]


@pytest.mark.slow
def test_validation_over_two_ranks_is_the_whole_val_split_exactly(runs, files):
    """The record's loss and accuracy equal one process scoring every val image with the saved weights."""
    _, val = datasets.read_datasets("imagefolder", files["data_dir"])
    for run in runs.values():
        model = more_models.resnet18(num_classes=2)
        model.load_state_dict(run["weights"])
        model.eval()
        images, labels = datasets.as_tensors(val)
        with torch.no_grad():
            logits = model(images)
        last = run["record"]["per_epoch"][-1]
        assert last["test_samples"] == 2 * VAL_PER_CLASS
        correct = int((logits.argmax(1) == labels).sum())
        assert last["test_accuracy"] == correct / len(labels)
        assert last["test_loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)


def ddp_reduced_bytes(rank, world_size):
    """For --finetune head and all: (bytes DDP hands to its all-reduces in one backward pass,
    counted by a communication hook; bytes of gradient of what trains)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    counts = {}
    for mode in ("head", "all"):
        torch.manual_seed(0)
        model = more_models.resnet18(num_classes=2)
        finetune.freeze(model, mode)
        model = DDP(model)
        reduced = []

        def counting_allreduce(state, bucket):
            reduced.append(bucket.buffer().numel() * bucket.buffer().element_size())
            tensor = bucket.buffer().div_(world_size)
            return torch.distributed.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, counting_allreduce)
        model(torch.randn(2, 3, 64, 64)).sum().backward()
        counts[mode] = (sum(reduced), finetune.gradient_bytes(model))
    return counts


@pytest.mark.slow
def test_ddp_all_reduces_exactly_the_gradients_of_what_trains():
    for counts in run_in_group(ddp_reduced_bytes):
        for reduced, counted in counts.values():
            assert reduced == counted
        assert counts["head"][1] == 4 * (512 * 2 + 2)  # fc: 2 x 512 weights and 2 biases, float32
        assert counts["all"][1] == 4 * sum(p.numel() for p in more_models.resnet18(num_classes=2).parameters())


# ---------------------------------------------------------------- one-line errors

@pytest.mark.slow
def test_missing_pretrained_weights_name_the_download_command(files, tmp_path):
    done = run_python("step6_finetune.py", "--pretrained", "--data-dir", files["data_dir"],
                      "--checkpoint-dir", tmp_path / "c", env=script_env(TORCH_HOME=tmp_path / "torch-home"))
    assert_one_line_error(done, "ResNet-18 weights", "not found",
                          "python scripts/tools/download_data.py resnet18-weights")


@pytest.mark.slow
def test_a_missing_image_folder_names_the_hymenoptera_download(tmp_path, files):
    done = run_python("step6_finetune.py", "--weights", files["weights"], "--data-dir", tmp_path / "nothing")
    assert_one_line_error(done, "no train/ and no val/", "python scripts/tools/download_data.py hymenoptera")


@pytest.mark.slow
def test_weights_of_another_model_are_refused_in_one_line(tmp_path, files):
    """A world of one (python): each rank reads the file and checks its layers alike, whatever the world."""
    torch.save(models.Net().state_dict(), tmp_path / "net.pt")
    done = run_python("step6_finetune.py", "--weights", tmp_path / "net.pt", "--data-dir", files["data_dir"],
                      "--checkpoint-dir", tmp_path / "c")
    assert_one_line_error(done, "does not hold this model's layers", "give weights of the same --model")


def test_pretrained_and_weights_are_one_or_the_other():
    with pytest.raises(SystemExit):
        parse_args(["--pretrained", "--weights", "w.pt"], add_arguments=step6_finetune.add_arguments)
