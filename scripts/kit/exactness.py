"""Full FP32 arithmetic and fixed cuDNN algorithms, for the runs the course compares to a tolerance.
Kit: a learner may skip this module (notebook 02 says what it is for).

On a GPU, PyTorch's defaults let cuDNN run FP32 convolutions in TF32, which keeps 10 bits of mantissa, and use
algorithms whose sums may run in another order from one call to the next; ``torch.backends.cudnn.benchmark = True``,
where something sets it, also lets cuDNN pick each algorithm by timing the candidates. Any of them may move
results past the 1e-6 that demos/verify_equivalence.py (notebook 02) allows. ``exact_math()`` turns them all off
in the process that calls it; ``math_settings()`` reads the flags back, for records and checks. On a CPU the flags
change nothing (they govern cuBLAS and cuDNN only); they are set and read there all the same.

``torch.use_deterministic_algorithms(True)`` is not set: the checks compare to 1e-6, not bit for bit;
``cudnn.deterministic`` already fixes cuDNN's convolutions; and the global switch raises on every operation
without a deterministic CUDA kernel (its documentation lists them), NLLLoss among them, which the Net's
cross_entropy calls. torch 2.14 no longer asks for CUBLAS_WORKSPACE_CONFIG with it.
"""
import torch

# What math_settings() reads after exact_math(): in every process of a check, or the check is not the course's.
EXACT = {
    "cuda_matmul_fp32_precision": "ieee",
    "cudnn_conv_fp32_precision": "ieee",
    "cudnn_rnn_fp32_precision": "ieee",
    "cuda_matmul_allow_tf32": False,
    "cudnn_allow_tf32": False,
    "float32_matmul_precision": "highest",
    "cudnn_benchmark": False,
    "cudnn_deterministic": True,
}


def exact_math():
    """Turn off TF32 and cuDNN's algorithm search in this process; return the flags as ``math_settings()`` reads
    them. Call it in the processes that compute (each rank), before the first convolution."""
    # TF32: https://docs.pytorch.org/docs/stable/notes/numerical_accuracy.html#tensorfloat-32-tf32-on-nvidia-ampere-and-later-devices
    # and https://docs.pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices.
    # torch 2.9 and later prefer the per-operator fp32_precision ("ieee": FP32 inside the kernel too) and say the
    # allow_tf32 flags are "going to be deprecated"; they do not support a mix of the two, and reading cuDNN's
    # allow_tf32 after the newer API alone raises. kit/mfu.py reads allow_tf32 for every run's record, so both are
    # set, the older first (setting it resets the per-operator values), and both read False/"ieee".
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS: already False by default since torch 1.12
    torch.backends.cudnn.allow_tf32 = False  # cuDNN: True by default, so convolutions run in TF32 on Ampere+
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cudnn.rnn.fp32_precision = "ieee"
    # cuDNN's algorithm: https://docs.pytorch.org/docs/stable/notes/randomness.html#cuda-convolution-benchmarking
    # benchmark=True times the candidate algorithms and may pick another one in each process or run.
    torch.backends.cudnn.benchmark = False
    # https://docs.pytorch.org/docs/stable/notes/randomness.html#cuda-convolution-determinism: even a fixed
    # algorithm may be nondeterministic (atomic adds in the backward pass) unless this is set.
    torch.backends.cudnn.deterministic = True
    return math_settings()


def math_settings():
    """The flags exact_math() sets, as this process has them now, JSON-ready. The attributes are those of
    https://docs.pytorch.org/docs/stable/backends.html; reading them needs no GPU."""
    return {
        "cuda_matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision,
        "cudnn_conv_fp32_precision": torch.backends.cudnn.conv.fp32_precision,
        "cudnn_rnn_fp32_precision": torch.backends.cudnn.rnn.fp32_precision,
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
    }


def is_exact(settings):
    """Whether ``settings`` (math_settings() of one process) are exact_math()'s."""
    return settings == EXACT
