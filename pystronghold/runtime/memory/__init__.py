"""Where block states live: byte layout, host/NVMe placement, the file tier, the host store."""
