"""Notebook 06, exercise 1: freeze a ResNet-18 but for layer4 and fc, and wrap it in DDP, for a fine-tune."""
from torch.nn.parallel import DistributedDataParallel as DDP

EXERCISE = "06.1"


def frozen_after_wrapping(model):
    wrapped = DDP(model)  # DDP has already chosen every parameter: it waits for gradients the frozen ones never get
    for name, parameter in wrapped.module.named_parameters():
        parameter.requires_grad = name.startswith(("layer4.", "fc."))
    return wrapped


def nothing_frozen(model):
    return DDP(model)


def only_the_head(model):
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith("fc.")  # layer4 frozen too
    return DDP(model)


def not_wrapped(model):
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(("layer4.", "fc."))
    return model  # each rank trains on its own images alone


def stem_left_training(model):
    for stage in (model.layer1, model.layer2, model.layer3):
        stage.requires_grad_(False)  # conv1 and bn1, before layer1, still train
    return DDP(model)


def head_frozen(model):
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith("layer4.")
    return DDP(model)


MISTAKES = [
    ({"wrap_for_finetune": frozen_after_wrapping}, "freeze before you wrap: DDP fixes the parameters it averages "
                                                   "when it is built"),
    ({"wrap_for_finetune": nothing_frozen}, "the whole model's gradients"),
    ({"wrap_for_finetune": only_the_head}, "the head's alone: layer4 must train too"),
    ({"wrap_for_finetune": not_wrapped}, "the ranks' weights differ after a step"),
    ({"wrap_for_finetune": stem_left_training}, "conv1.weight requires grad, but only layer4 and fc should train"),
    ({"wrap_for_finetune": head_frozen}, "fc.weight is frozen, but every parameter of layer4 and fc should train"),
]
