"""The runtime's timeline: clocks, the trace and its host-timed spans."""
