"""CIFAR-10 and ResNet-18 (as the Palmetto DDP tutorial trains them): the data, the augmentation, every training
script, and checkpoints that resume exactly.

CIFAR-10 cannot be downloaded here. The tests write its files in its own format
(tests/data_makers.py says how, and why torchvision's md5 check is replaced for them and
nothing else), and the synthetic-cifar10 data set covers the same shapes in memory.
"""
import subprocess

import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from data_makers import accepting_any_md5, write_cifar10
from helpers import (
    REPO,
    SCRIPTS,
    assert_ok,
    assert_one_line_error,
    assert_same_weights,
    read_json,
    restarts_in,
    run_outputs,
    run_python,
    saved_weights,
    script_env,
    torchrun_command,
)
from kit import datasets, more_models
from lesson import data, models

PER_BATCH, TEST_IMAGES = 40, 40  # 5 x 40 = 200 training images
# 2 epochs of 2 steps (a ResNet-18 step costs about half a CPU second, its checkpoint as much), a checkpoint every
# 3 steps and at each epoch end: steps 2, 3 and 4. A run stopped after step 4, before its epoch's end, resumes
# mid-epoch from step 3 (epoch 2, 1 batch done), and trains step 4 again: its batch, crops and flips included.
RUN = ("--dataset", "cifar10", "--model", "resnet18", "--epochs", 2, "--max-steps", 2, "--batch-size", 16,
       "--checkpoint-every", 3)
STOP_STEP = 4


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    """CIFAR-10's files, written here, and the launcher that lets torchvision read them."""
    folder = tmp_path_factory.mktemp("cifar")
    return {"data_dir": write_cifar10(folder / "data", per_batch=PER_BATCH, test_images=TEST_IMAGES),
            "launcher": accepting_any_md5(folder)}


def run_on_cifar(cifar, script, *args, nproc=1, launcher=()):
    """A course script on the written CIFAR-10 files, with python (nproc 1) or torchrun."""
    args = (*args, "--data-dir", cifar["data_dir"])
    if nproc == 1:
        return run_python(cifar["launcher"], SCRIPTS / script, *args)
    command = torchrun_command(script, *args, nproc=nproc, launcher=launcher)
    script_at = command.index(str(SCRIPTS / script))
    command[script_at:script_at + 1] = [str(cifar["launcher"]), str(SCRIPTS / script)]
    return subprocess.run(command, cwd=REPO, env=script_env(restarts=restarts_in(launcher)), capture_output=True,
                          text=True, timeout=300)


# ---------------------------------------------------------------- the data set

def test_the_written_files_load_through_torchvision_with_their_classes_and_splits(cifar, monkeypatch):
    import torchvision.datasets.cifar as cifar_module

    monkeypatch.setattr(cifar_module, "check_integrity", lambda fpath, md5=None: True)
    train, test = data.load_datasets("cifar10", cifar["data_dir"])
    assert (len(train), len(test)) == (5 * PER_BATCH, TEST_IMAGES)
    assert train.classes[:2] == ["airplane", "automobile"] and train.data.shape == (200, 32, 32, 3)
    assert not (train.data[:TEST_IMAGES] == test.data).all()  # the test split is its own file


def test_in_memory_images_equal_the_test_transform_bit_for_bit(cifar, monkeypatch):
    import torchvision.datasets.cifar as cifar_module

    monkeypatch.setattr(cifar_module, "check_integrity", lambda fpath, md5=None: True)
    _, test = data.load_datasets("cifar10", cifar["data_dir"])
    images, labels = datasets.as_tensors(test)
    one_by_one = torch.stack([test[i][0] for i in range(len(test))])
    assert torch.equal(images, one_by_one) and labels.tolist() == test.targets


def test_batch_augmentation_is_torchvisions_crop_and_flip():
    """crop_and_flip on normalised tensors = torchvision's pad (black), crop, flip, then normalise."""
    train, _ = datasets.read_datasets("synthetic-cifar10", ".")
    _, to_tensor = datasets.cifar10_transforms()  # ToTensor + Normalize
    images, _ = datasets.as_tensors(torch.utils.data.Subset(train, range(4)))
    tops, lefts, flips = (torch.tensor([0, 8, 3, 5]), torch.tensor([8, 0, 4, 1]),
                          torch.tensor([True, False, True, False]))
    black = -torch.tensor(datasets.CIFAR10_MEAN) / torch.tensor(datasets.CIFAR10_STD)
    ours = datasets.crop_and_flip(images, tops, lefts, flips, datasets.CIFAR10_PADDING, black)
    for i in range(4):
        picture = TF.crop(TF.pad(Image.fromarray(train.data[i]), datasets.CIFAR10_PADDING, fill=0), int(tops[i]),
                          int(lefts[i]), 32, 32)
        expected = to_tensor(TF.hflip(picture) if flips[i] else picture)
        assert torch.allclose(ours[i], expected, atol=1e-6), i


def augmented_epoch(seed, skip=0):
    train, _ = datasets.read_datasets("synthetic-cifar10", ".")
    batches = data.TensorBatches(torch.utils.data.Subset(train, range(64)), range(64), 16, "cpu",
                                 augment=datasets.batch_augmentation("cifar10"))
    return [images for images, _ in batches.iterate(skip, seed=seed)], batches


def test_in_memory_augmentation_draws_from_its_own_generators_and_replays_after_a_skip():
    before = torch.get_rng_state()
    epoch, batches = augmented_epoch(seed=7)
    assert torch.equal(torch.get_rng_state(), before), "augmentation must not draw from the global stream"
    plain = batches.images[:16]
    assert not torch.equal(epoch[0], plain)  # the batch really is augmented
    resumed, _ = augmented_epoch(seed=7, skip=2)  # a resumed epoch starts at its third batch
    assert len(resumed) == 2 and all(torch.equal(a, b) for a, b in zip(resumed, epoch[2:]))
    other_epoch, _ = augmented_epoch(seed=8)  # another epoch (or rank): other crops and flips
    assert not torch.equal(other_epoch[0], epoch[0])


# ---------------------------------------------------------------- the models

def training_flops_per_image(model):
    counter = FlopCounterMode(display=False)
    with counter:
        model(torch.zeros(2, 3, 32, 32)).sum().backward()
    return counter.get_total_flops() / 2


def test_the_cifar_stem_costs_about_15_times_the_seed_models_compute():
    seed_model, cifar_stem = more_models.resnet18(), more_models.resnet18_cifar()
    ratio = training_flops_per_image(cifar_stem) / training_flops_per_image(seed_model)
    assert 14 < ratio < 16, ratio
    assert seed_model(torch.zeros(2, 3, 32, 32)).shape == cifar_stem(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def normalised(output):
    """Rows that are already probabilities (softmax's) or log-probabilities (log_softmax's)."""
    ones = torch.ones(len(output))
    return (torch.allclose(output.sum(dim=1), ones, atol=1e-4)
            or torch.allclose(output.exp().sum(dim=1), ones, atol=1e-4))


@pytest.mark.parametrize("name", models.MODELS)
def test_every_model_returns_logits_not_probabilities(name):
    """The loss is F.cross_entropy, which applies log_softmax itself: a model that ended in
    softmax or log_softmax would have it applied twice. Logits take either sign, and their
    rows neither sum to 1 nor do their exponentials."""
    channels, height, width = more_models.INPUTS[name]
    torch.manual_seed(0)
    model = models.MODELS[name](dropout=True).eval()
    images = torch.randn(8, channels, height or 32, width or 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(images)
    assert output.shape == (8, 10)
    assert (output < 0).any() and (output > 0).any(), output  # softmax's are all >= 0, log_softmax's all <= 0
    assert not normalised(output), output
    # The check can fail: the same outputs after softmax or log_softmax are caught.
    assert normalised(F.softmax(output, dim=1)) and normalised(F.log_softmax(output, dim=1))


@pytest.mark.parametrize("model, dataset, fix", [("net", "synthetic-cifar10", "--model resnet18 or resnet18-cifar"),
                                                 ("resnet18", "mnist5k", "--model net")])
@pytest.mark.slow
def test_a_model_that_cannot_take_the_images_is_refused_in_one_line(model, dataset, fix):
    assert_one_line_error(run_python("step1_baseline.py", "--dataset", dataset, "--model", model), "takes", fix)


# ---------------------------------------------------------------- every script, end to end

SCRIPT_CASES = {"step1_baseline": 1, "step3_data_parallel": 1, "step2_allreduce": 2, "step4_ddp": 2}
# step1_baseline and step4_ddp train ResNet-18 on these files in the uninterrupted runs below: their record and
# weights are checked here, without a run of their own.
TRAINED_BY_THE_REFERENCE_RUNS = {"step1_baseline": "single", "step4_ddp": "ddp"}


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
@pytest.mark.parametrize("script", SCRIPT_CASES)
def test_every_training_script_trains_resnet18_on_cifar10(script, cifar, request, tmp_path):
    world_size = SCRIPT_CASES[script]
    if script in TRAINED_BY_THE_REFERENCE_RUNS:
        folder = request.getfixturevalue("uninterrupted_resnet18")["folder"]
        name = TRAINED_BY_THE_REFERENCE_RUNS[script]
    else:
        folder, name = tmp_path, "run"
        assert_ok(run_on_cifar(cifar, f"{script}.py", "--dataset", "cifar10", "--model", "resnet18", "--epochs", 1,
                               "--max-steps", 1, "--batch-size", 16, *run_outputs(folder, name), nproc=world_size))
    record = read_json(folder / "results" / f"{name}.json")
    assert (record["dataset"], record["model"], record["world_size"]) == ("cifar10", "resnet18", world_size)
    assert record["per_epoch"][0]["test_samples"] == TEST_IMAGES
    assert more_models.resnet18().load_state_dict(saved_weights(folder, name))  # strict: a plain ResNet-18's weights


@pytest.mark.slow
def test_the_synthetic_set_trains_without_any_file(tmp_path):
    """A world of one (python): the data set is made in every process alike, whatever the world size."""
    done = run_python("step4_ddp.py", "--dataset", "synthetic-cifar10", "--model", "resnet18", "--epochs", 1,
                      "--max-steps", 1, "--batch-size", 16, *run_outputs(tmp_path, "synthetic"),
                      "--data-dir", tmp_path / "nothing-here")
    assert_ok(done)
    record = read_json(tmp_path / "results" / "synthetic.json")
    assert record["dataset"] == "synthetic-cifar10" and record["per_epoch"][0]["test_samples"] == 1000


# ---------------------------------------------------------------- exact resume

@pytest.fixture(scope="module")
def uninterrupted_resnet18(cifar, tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(run_on_cifar(cifar, "step1_baseline.py", *RUN, *run_outputs(folder, "single")))
    assert_ok(run_on_cifar(cifar, "step4_ddp.py", *RUN, *run_outputs(folder, "ddp"), nproc=2))
    return {"single": saved_weights(folder, "single"), "ddp": saved_weights(folder, "ddp"), "folder": folder}


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
def test_the_reference_runs_trained(uninterrupted_resnet18):
    torch.manual_seed(0)
    untrained = more_models.resnet18().state_dict()
    assert not torch.equal(untrained["fc.weight"], uninterrupted_resnet18["single"]["fc.weight"])
    assert not torch.equal(uninterrupted_resnet18["single"]["fc.weight"], uninterrupted_resnet18["ddp"]["fc.weight"])


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
def test_a_stopped_resnet18_run_resumes_mid_epoch_to_the_same_weights(cifar, uninterrupted_resnet18, tmp_path):
    """Augmentation on: the resumed epoch's crops and flips must be the ones the first run drew."""
    stopped = run_on_cifar(cifar, "step1_baseline.py", *RUN, *run_outputs(tmp_path, "stopped"), "--fault", "exit",
                           "--fault-step", STOP_STEP)
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    resumed = run_on_cifar(cifar, "step1_baseline.py", *RUN, *run_outputs(tmp_path, "stopped"), "--resume")
    assert_ok(resumed)
    assert "checkpoint-00000003.pt: epoch 2, 1 of" in resumed.stdout, resumed.stdout
    assert_same_weights(saved_weights(tmp_path, "stopped"), uninterrupted_resnet18["single"])


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
def test_a_killed_ddp_worker_is_restarted_and_ends_with_the_same_weights(cifar, uninterrupted_resnet18, tmp_path):
    done = run_on_cifar(cifar, "step4_ddp.py", *RUN, *run_outputs(tmp_path, "killed"), "--fault", "kill",
                        "--fault-rank", 1, "--fault-step", STOP_STEP, nproc=2, launcher=("--max-restarts=1",))
    assert_ok(done)
    assert "checkpoint-00000003.pt: epoch 2, 1 of" in done.stdout, done.stdout
    assert_same_weights(saved_weights(tmp_path, "killed"), uninterrupted_resnet18["ddp"])


def dataloader_run(cifar, folder, name, workers, *extra):
    return run_on_cifar(cifar, "step1_baseline.py", *RUN, "--loader", "dataloader", "--workers", workers,
                        *run_outputs(folder, name), *extra)


@pytest.mark.slow  # ResNet-18 runs: make test runs it, make test-fast leaves it out
@pytest.mark.parametrize("workers", [0, 1])
def test_the_dataloader_route_resumes_exactly_without_workers_and_not_with_them(cifar, tmp_path, workers):
    """No workers: torchvision's crops and flips draw from the training process's stream, which
    the checkpoint saves, so the resume is exact. With a worker: its stream was seeded when it
    started and cannot be continued; the data order is the same, the crops and flips are not."""
    assert_ok(dataloader_run(cifar, tmp_path, "whole", workers))
    stopped = dataloader_run(cifar, tmp_path, "stopped", workers, "--fault", "exit", "--fault-step", STOP_STEP)
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    assert_ok(dataloader_run(cifar, tmp_path, "stopped", workers, "--resume"))
    whole, resumed = (read_json(tmp_path / "results" / f"{name}.json") for name in ("whole", "stopped"))
    assert [e["first_indices"] for e in resumed["per_epoch"]] == [e["first_indices"] for e in whole["per_epoch"]]
    same = all(torch.equal(a, b) for a, b in zip(saved_weights(tmp_path, "whole").values(),
                                                  saved_weights(tmp_path, "stopped").values()))
    assert same == (workers == 0)


# ---------------------------------------------------------------- one-line errors

@pytest.mark.slow
def test_missing_cifar10_names_the_download_command(tmp_path):
    done = run_python("step1_baseline.py", "--dataset", "cifar10", "--model", "resnet18", "--data-dir", tmp_path)
    assert_one_line_error(done, "cifar10 not found", "python scripts/tools/download_data.py cifar10")


@pytest.mark.slow
def test_cifar10_files_that_fail_the_md5_check_are_called_damaged(cifar):
    done = run_python("step1_baseline.py", "--dataset", "cifar10", "--model", "resnet18",
                      "--data-dir", cifar["data_dir"])
    assert_one_line_error(done, "is damaged (their md5 sums are not CIFAR-10's)",
                          "python scripts/tools/download_data.py cifar10")
