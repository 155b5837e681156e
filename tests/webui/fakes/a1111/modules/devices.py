"""Fake of A1111 modules/devices.py: the WebUI's torch device."""

import torch

device = torch.device("cpu")
