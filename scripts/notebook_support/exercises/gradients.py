"""What several rank checks compute: a model's gradient on some images, flattened, and whether two such tensors agree
to float32 rounding. Notebook support: a learner may skip this module.
"""
import torch
import torch.nn.functional as F


def flat_gradient(model, images, labels):
    """The gradient of the mean cross-entropy over these images, all parameters in one flat tensor (left in .grad)."""
    model.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def close(got, expected):
    """Equal to float32 rounding: the same sums in another order stay far inside these bounds."""
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-7)
