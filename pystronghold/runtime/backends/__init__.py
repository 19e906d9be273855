"""The device the window lives on: the CPU arena or CUDA memory and streams."""
