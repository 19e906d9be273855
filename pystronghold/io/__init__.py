"""Moving bytes: the async copy engine, the host arena and the file tier (NVMe).

    from pystronghold.io import CopyEngine, CopyHandle, CopyError, HostArena, FileStore
"""

from pystronghold.io.arena import HostArena
from pystronghold.io.copy_engine import CopyEngine, CopyError, CopyHandle
from pystronghold.io.file_store import FileStore

__all__ = ["CopyEngine", "CopyError", "CopyHandle", "FileStore", "HostArena"]
