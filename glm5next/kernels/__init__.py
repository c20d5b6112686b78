"""Triton kernels, each beside an fp32 PyTorch reference of the same signature."""
