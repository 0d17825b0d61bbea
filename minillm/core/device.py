"""Where tensors live: one function that turns "auto" / "cpu" / "cuda" into a `torch.device`."""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" means CUDA when `torch.cuda.is_available()`, else the CPU; asking for CUDA without one is an error."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a string like 'auto', 'cpu' or 'cuda', got {type(device).__name__}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
        dev = torch.device(device)
        # subtle: a model moved to "cuda" reports "cuda:0"; resolve to the indexed device so the two compare equal.
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {device!r}; choose one of {DEVICE_CHOICES}")


def as_device(device: object, name: str = "device") -> torch.device:
    """`device` (a torch.device, or a name torch reads: "cpu", "cuda", "cuda:1") as a torch.device, for a tensor
    store that allocates on it (the KV caches); a TypeError / ValueError naming `name` otherwise, not torch's own
    "Expected one of cpu, cuda, ... device type at start of device string", which names no argument; and CUDA
    without one is a ValueError here, not torch's AssertionError at the first allocation."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a torch.device or a device name ('cpu', 'cuda:0'), got "
                        f"{type(device).__name__}")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(str.__str__(device))
    except RuntimeError as e:
        raise ValueError(f"{name} must be a device name torch knows ('cpu', 'cuda', 'cuda:0', ...), got "
                         f"{device[:80]!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {str(dev)!r} requested but torch.cuda.is_available() is False")
    return dev


def place_with_model(setting: str | torch.device, model_device: torch.device) -> torch.device:
    """Where an engine runs: "auto" means wherever the model already is; anything else is resolved and returned."""
    if isinstance(setting, str) and setting == "auto":
        return torch.device(model_device)
    return resolve_device(setting)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work so a timer measures the work, not the launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
