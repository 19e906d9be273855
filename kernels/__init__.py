"""Triton kernels of pystronghold, installed as `pystronghold.kernels`."""
