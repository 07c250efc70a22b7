# Solution to notebook 06, exercise 1: what DDP sends per training step in a fine-tune.
# Gradients: DDP all-reduces one gradient per parameter that trains (requires_grad), float32: 4 bytes a value.
# Count parameters(), not state_dict(): BatchNorm's running_mean, running_var and num_batches_tracked are
# buffers, with no gradient, and DDP never all-reduces them.
# Buffers: DDP broadcasts every buffer from rank 0 before each training forward, whatever trains: two float32
# vectors per BatchNorm layer (4 bytes a value) and one int64 counter (8 bytes).
cifar_resnet = more_models.resnet18(num_classes=10)
head_bytes = 4 * sum(p.numel() for p in cifar_resnet.fc.parameters())  # 10 x 512 weights and 10 biases
layer4_and_head_bytes = head_bytes + 4 * sum(p.numel() for p in cifar_resnet.layer4.parameters())
buffer_bytes = sum(b.numel() * b.element_size() for b in cifar_resnet.buffers())  # 20 BatchNorm layers
