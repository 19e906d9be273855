"""What ``pystronghold.wrap`` accepts: the runtime's options and its compute precision."""
