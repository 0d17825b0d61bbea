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
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
        return torch.device(device)
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {device!r}; choose one of {DEVICE_CHOICES}")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work so a timer measures the work, not the launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
