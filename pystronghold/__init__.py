"""pystronghold: train models larger than accelerator memory.

Only a working window of transformer blocks lives on the accelerator; the rest sits in host memory
(and on NVMe); a fused CPU Adam updates each block while the accelerator runs backward.
"""

__version__ = "0.1.0"
