"""Triton-fused chunk kernels, each with a torch reference (used on CPU and in tests)."""
