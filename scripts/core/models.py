"""The networks the scripts can train, chosen with ``--model``."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CourseError


class Net(nn.Module):
    """The MNIST network of the pytorch/examples recipe: two convolutions, two linear layers.

    It returns logits, one raw score per class, and the loss is ``F.cross_entropy``,
    which applies log_softmax itself. (The recipe ends the network in log_softmax and
    uses nll_loss: the same function in two pieces. Feeding softmax into
    cross_entropy, a common slip, would apply it twice.)
    """

    def __init__(self, dropout=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


MODELS = {"net": Net}


def build_model(args):
    """The model ``--model`` names, initialised from ``--seed``: the same weights on every rank."""
    if args.model not in MODELS:
        raise CourseError(f"unknown --model {args.model!r}; choose one of: {', '.join(MODELS)}")
    torch.manual_seed(args.seed)
    return MODELS[args.model](dropout=args.dropout)
