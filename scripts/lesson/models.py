"""The model: the Net of the pytorch/examples MNIST recipe, and ``build_model`` for every ``--model``.

Every model returns logits, one raw score per class, and the loss is ``F.cross_entropy``, which
applies log_softmax itself. (The recipe ends the network in log_softmax and uses nll_loss: the same
function in two pieces. Feeding softmax into cross_entropy, a common slip, would apply it twice.)
The other models (BatchNorm, ResNet-18) are in ``kit/more_models.py``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from kit import datasets, more_models


class Net(nn.Module):
    """Two convolutions, two linear layers, dropout: the pytorch/examples MNIST network (1x28x28 images)."""

    def __init__(self, dropout=True, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


MODELS = {"net": Net, **more_models.MODELS}


def build_model(args):
    """The model ``--model`` names, with an output per class of ``--dataset``, initialised
    from ``--seed``: the same weights on every rank."""
    more_models.check_choice(args.model, args.dataset)  # a known model that takes the data set's images: else one line
    torch.manual_seed(args.seed)
    model = MODELS[args.model](dropout=args.dropout, num_classes=datasets.num_classes(args.dataset, args.data_dir))
    return more_models.with_sync_batchnorm(model, args.model, args.sync_bn, args.device)  # --sync-bn only


def unwrap(model):
    """The plain model inside a DataParallel or DistributedDataParallel wrapper."""
    return getattr(model, "module", model)
