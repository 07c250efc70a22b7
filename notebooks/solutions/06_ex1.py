# Solution to notebook 06, exercise 1: freeze all but layer4 and the head, then wrap in DDP.
# DDP picks the parameters it averages (those with requires_grad) when it is built: freeze first, then wrap.
# A frozen parameter gets no gradient, so DDP puts it in no bucket; on the CPU (gloo) DDP takes no device_ids.
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap_for_finetune(model):
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(("layer4.", "fc."))
    return DDP(model)
