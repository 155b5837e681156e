"""Fake of Forge backend/memory_management.py: the torch device Forge runs on."""

import torch


def get_torch_device():
    return torch.device("cpu")


def dtype_size(dtype):
    return torch.empty((), dtype=dtype).element_size()
