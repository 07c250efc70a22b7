"""Starting from pretrained weights: where they come from, what is kept, what trains. Machinery: a learner
may skip this module (notebook 06 uses it).

- ``read_weights``: torchvision's ImageNet weights for ResNet-18 (``--pretrained``), read
  from the torch hub cache and never downloaded here (a compute node has no internet,
  and every rank downloading at once would race), or a state_dict file (``--weights``);
- ``load_all_but_head``: every weight but the output layer's, which was made for the
  other data set's classes (ImageNet's 1,000); the head starts fresh;
- ``freeze``: ``--finetune head`` trains the head alone, ``--finetune all`` every layer;
- ``trainable_parameters``, ``gradient_bytes``: what trains, and what DDP all-reduces per step.
"""
from pathlib import Path

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from kit.errors import CourseError, first_line
from lesson.models import unwrap

HEAD = "fc."  # ResNet's output layer


def pretrained_file():
    """Where torchvision's ResNet-18 ImageNet weights sit in the torch hub cache
    ($TORCH_HOME/hub/checkpoints/, by default ~/.cache/torch/hub/checkpoints/)."""
    from torchvision.models import ResNet18_Weights

    url = ResNet18_Weights.IMAGENET1K_V1.url
    return Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]


def read_weights(weights=None):
    """The state_dict of the file ``weights`` (--weights FILE) or, without one, torchvision's ImageNet weights
    (--pretrained), on the CPU."""
    if weights is not None:
        path = Path(weights)
        fix = "check --weights (a state_dict saved with torch.save, e.g. by --save)"
    else:
        path = pretrained_file()
        fix = ("fetch them on a machine with internet: python scripts/tools/download_data.py resnet18-weights (or pass "
               "--weights FILE)")
    if not path.is_file():
        what = f"--weights {path}" if weights is not None else f"torchvision's ResNet-18 weights ({path})"
        raise CourseError(f"{what} not found; {fix}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated file, not a torch file, or objects weights_only refuses
        raise CourseError(f"{path} cannot be read as a state_dict ({first_line(error)}); {fix}") from None
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise CourseError(f"{path} is not a state_dict of tensors; {fix}")
    consume_prefix_in_state_dict_if_present(state, "module.")  # a DDP model's state_dict, saved unwrapped or not
    return state


def load_all_but_head(model, state, source):
    """Copy every weight of ``state`` into ``model`` but the head's: those have as many
    outputs as the classes of the data set they were trained on, not of this one."""
    body = {name: value for name, value in state.items() if not name.startswith(HEAD)}
    expected = {name for name in model.state_dict() if not name.startswith(HEAD)}
    if set(body) != expected:
        missing, unexpected = sorted(expected - set(body)), sorted(set(body) - expected)
        raise CourseError(f"{source} does not hold this model's layers ({len(missing)} missing, e.g. "
                          f"{missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}); "
                          f"give weights of the same --model")
    try:
        model.load_state_dict(body, strict=False)
    except RuntimeError as error:  # the same names with other shapes
        raise CourseError(f"{source} has weights of other shapes than --model's ({first_line(error)})") from None


def freeze(model, finetune):
    """``head``: only the output layer trains (requires_grad); ``all``: every layer does.
    A frozen layer gets no gradient and no update; its BatchNorm statistics still follow
    the new data while the model trains, as in PyTorch's transfer-learning tutorial."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad = finetune == "all" or name.startswith(HEAD)


def trainable_parameters(model):
    """(parameters that train, all parameters), in numbers of values."""
    parameters = list(unwrap(model).parameters())
    return sum(p.numel() for p in parameters if p.requires_grad), sum(p.numel() for p in parameters)


def gradient_bytes(model):
    """Bytes of gradient one step produces, which DDP all-reduces: trainable parameters only."""
    return sum(p.numel() * p.element_size() for p in unwrap(model).parameters() if p.requires_grad)
