"""Moving bytes: the async copy engine and the host arena.

    from pystronghold.io import CopyEngine, CopyHandle, CopyError, HostArena
"""

from pystronghold.io.arena import HostArena
from pystronghold.io.copy_engine import CopyEngine, CopyError, CopyHandle

__all__ = ["CopyEngine", "CopyError", "CopyHandle", "HostArena"]
