"""Torch-free engine core: requests, scheduler, cache manager. Must not import torch or the model."""
