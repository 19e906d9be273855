"""Blocks streamed through the window: its slots, the schedule, the pass executor, saved
block inputs and their spill, the relay schedule, layer drop."""
