"""Moving bytes: the async copy engine, the host arena and the file tier (NVMe).

    from pystronghold.io import CopyEngine, CopyHandle, CopyError, HostArena, FileStore
    from pystronghold.io import ScratchDir, DiskSpaceError, free_bytes, check_free_space
"""

from pystronghold.io.arena import HostArena
from pystronghold.io.copy_engine import CopyEngine, CopyError, CopyHandle
from pystronghold.io.file_store import FileStore
from pystronghold.io.scratch import DiskSpaceError, ScratchDir, check_free_space, free_bytes

__all__ = ["CopyEngine", "CopyError", "CopyHandle", "DiskSpaceError", "FileStore", "HostArena",
           "ScratchDir", "check_free_space", "free_bytes"]
