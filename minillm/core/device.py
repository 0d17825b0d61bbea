"""Where tensors live: one function that turns "auto" / "cpu" / "cuda" into a `torch.device`."""

from __future__ import annotations

import torch

from minillm.core.config import check_device

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


def place_with_model(setting: str | torch.device, model_device: torch.device) -> torch.device:
    """Where an engine runs: "auto" means wherever the model already is; anything else is resolved and returned."""
    if isinstance(setting, str) and setting == "auto":
        return torch.device(model_device)
    return resolve_device(setting)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work so a timer measures the work, not the launch."""
    if check_device("device", device).type == "cuda":
        torch.cuda.synchronize(device)
