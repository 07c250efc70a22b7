"""Step 6: a replica of the model over two devices, for DDP combined with model parallelism
(scripts/step6_model_parallel.py; notebook 06).

ResNet-18's stem, layer1 and layer2 sit on device 2*LOCAL_RANK, layer3, layer4 and the head on
device 2*LOCAL_RANK+1: GPU numbers start again on every node, so they come from the local rank.
"""
import torch
import torch.nn as nn

from kit.errors import CourseError


class TwoDeviceResNet(nn.Module):
    """A torchvision ResNet in two halves, one per device. Its layers keep their names,
    so its state_dict is the plain ResNet's: the weights move between the two freely."""

    FIRST_HALF = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2")
    SECOND_HALF = ("layer3", "layer4", "avgpool", "fc")

    def __init__(self, resnet, first_device, second_device):
        super().__init__()
        self.first_device, self.second_device = first_device, second_device
        for name in self.FIRST_HALF:
            setattr(self, name, getattr(resnet, name).to(first_device))
        for name in self.SECOND_HALF:
            setattr(self, name, getattr(resnet, name).to(second_device))

    def forward(self, x):
        x = x.to(self.first_device)
        for name in self.FIRST_HALF:
            x = getattr(self, name)(x)
        x = x.to(self.second_device)  # the activations cross to the second device
        x = self.avgpool(self.layer4(self.layer3(x)))
        return self.fc(torch.flatten(x, 1)).to(self.first_device)  # the logits come back to the labels


def replica_devices(runtime):
    """This process's two devices: cuda:2*LOCAL_RANK and cuda:2*LOCAL_RANK+1, or the CPU twice."""
    if runtime.device.type != "cuda":
        return runtime.device, runtime.device
    gpus, processes = torch.cuda.device_count(), runtime.local_world_size
    if gpus < 2 * processes:
        fix = f"--nproc-per-node={gpus // 2}" if gpus >= 2 else "--device cpu"
        raise CourseError(f"model parallelism needs 2 GPUs per process: {processes} process(es) on this node need "
                          f"{2 * processes} GPUs and it has {gpus}; launch with {fix}")
    return torch.device("cuda", 2 * runtime.local_rank), torch.device("cuda", 2 * runtime.local_rank + 1)
