# Solution to notebook 06, exercise 1: the gradient bytes DDP all-reduces in a fine-tune.
# DDP all-reduces one gradient per parameter that trains (requires_grad), float32: 4 bytes a value.
# Count parameters(), not state_dict(): BatchNorm's running_mean, running_var and
# num_batches_tracked are buffers, with no gradient, and DDP never all-reduces them.
cifar_resnet = more_models.resnet18(num_classes=10)
head_bytes = 4 * sum(p.numel() for p in cifar_resnet.fc.parameters())  # 10 x 512 weights and 10 biases
layer4_and_head_bytes = head_bytes + 4 * sum(p.numel() for p in cifar_resnet.layer4.parameters())
