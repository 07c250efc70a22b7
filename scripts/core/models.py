"""The networks the scripts can train, chosen with ``--model``."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CourseError


class Net(nn.Module):
    """The MNIST network of the pytorch/examples recipe: two convolutions, two linear layers.

    It returns log-probabilities, so the loss is ``F.nll_loss`` (log_softmax followed
    by nll_loss is cross-entropy; feeding softmax into CrossEntropyLoss would apply
    it twice).
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
        return F.log_softmax(self.fc2(x), dim=1)


MODELS = {"net": Net}


def build_model(args):
    if args.model not in MODELS:
        raise CourseError(f"unknown --model {args.model!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[args.model](dropout=args.dropout)
