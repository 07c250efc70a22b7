"""A stand-in for GPUs, for the tests of the doctor and the architecture check on machines that have none.

With this folder on PYTHONPATH, Python imports this module as it starts (the `site` module's
sitecustomize hook). When COURSE_STAND_IN_GPUS lists compute capabilities ("9.0,7.0": GPU 0 of
capability 9.0, GPU 1 of 7.0), torch.cuda answers the questions the course asks about GPUs as CUDA
would on such a host: which are visible (numbered, and hidden, by CUDA_VISIBLE_DEVICES), their names,
capabilities and UUIDs. torch.cuda.get_arch_list() stays the real one: the installed build's. Nothing
can run on these GPUs; a test that needs a collective uses gloo.
"""
import os

CAPABILITIES = os.environ.get("COURSE_STAND_IN_GPUS")

if CAPABILITIES:
    import socket
    from types import SimpleNamespace

    import torch

    GPUS = [tuple(int(part) for part in capability.split(".")) for capability in CAPABILITIES.split(",")]

    def physical_indices():
        """The GPUs this process sees, as CUDA reads CUDA_VISIBLE_DEVICES: up to the first entry that is not a
        GPU of this host."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return list(range(len(GPUS)))
        indices = []
        for entry in visible.split(","):
            if not entry.strip().isdigit() or int(entry) >= len(GPUS):
                break
            indices.append(int(entry))
        return indices

    def properties(device=None):
        index = 0 if device is None else getattr(device, "index", device) or 0
        physical = physical_indices()[index]
        major, minor = GPUS[physical]
        return SimpleNamespace(name=f"Stand-in GPU {major}.{minor}", major=major, minor=minor,
                               uuid=f"GPU-stand-in-{socket.gethostname()}-{physical}", total_memory=16 * 2**30)

    torch.cuda.is_available = lambda: bool(physical_indices())
    torch.cuda.device_count = lambda: len(physical_indices())
    torch.cuda.get_device_properties = properties
    torch.cuda.get_device_capability = lambda device=None: (properties(device).major, properties(device).minor)
    torch.cuda.get_device_name = lambda device=None: properties(device).name
