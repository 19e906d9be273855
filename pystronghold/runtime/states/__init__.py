"""Whole values of a wrapped model: its state dict, the optimizer's and the engine's own."""
