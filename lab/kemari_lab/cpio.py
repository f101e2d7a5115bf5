"""A writer for initramfs archives (cpio "newc" format, as the kernel reads them).

Written here rather than driving the cpio tool so that archives are
reproducible (fixed mtimes, uid 0) and need no root or fakeroot.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import BinaryIO

_MAGIC = b"070701"


class CpioWriter:
    """Appends entries to a newc archive; call :meth:`close` to write the trailer."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._ino = 1
        self._dirs: set[str] = set()
        self._closed = False

    def _entry(self, name: str, mode: int, data: bytes) -> None:
        name_bytes = name.encode() + b"\x00"
        fields = [
            self._ino,  # inode
            mode,
            0,  # uid
            0,  # gid
            1,  # nlink
            0,  # mtime
            len(data),
            0,  # devmajor
            0,  # devminor
            0,  # rdevmajor
            0,  # rdevminor
            len(name_bytes),
            0,  # check
        ]
        self._ino += 1
        header = _MAGIC + b"".join(b"%08X" % f for f in fields)
        self._out.write(header)
        self._out.write(name_bytes)
        self._out.write(b"\x00" * ((4 - (len(header) + len(name_bytes)) % 4) % 4))
        self._out.write(data)
        self._out.write(b"\x00" * ((4 - len(data) % 4) % 4))

    def add_dir(self, path: str) -> None:
        """Adds a directory and its missing parents."""
        path = path.strip("/")
        if not path or path in self._dirs:
            return
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        self.add_dir(parent)
        self._dirs.add(path)
        self._entry(path, stat.S_IFDIR | 0o755, b"")

    def _parent(self, path: str) -> str:
        path = path.strip("/")
        if "/" in path:
            self.add_dir(path.rsplit("/", 1)[0])
        return path

    def add_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Adds a regular file with the given contents."""
        self._entry(self._parent(path), stat.S_IFREG | mode, data)

    def add_file(self, path: str, source: Path, mode: int | None = None) -> None:
        """Adds a copy of `source` (symlinks followed) at `path`."""
        data = source.read_bytes()
        if mode is None:
            mode = source.stat().st_mode & 0o7777
        self.add_bytes(path, data, mode)

    def add_symlink(self, path: str, target: str) -> None:
        """Adds a symbolic link `path` -> `target`."""
        self._entry(self._parent(path), stat.S_IFLNK | 0o777, target.encode())

    def close(self) -> None:
        """Writes the trailer (once)."""
        if not self._closed:
            self._entry("TRAILER!!!", 0, b"")
            self._closed = True


def read_names(data: bytes) -> list[str]:
    """Lists the entry names of a newc archive (for tests and checks)."""
    names: list[str] = []
    pos = 0
    while pos + 110 <= len(data):
        if data[pos : pos + 6] != _MAGIC:
            raise ValueError(f"bad cpio magic at offset {pos}")
        filesize = int(data[pos + 54 : pos + 62], 16)
        namesize = int(data[pos + 94 : pos + 102], 16)
        name = data[pos + 110 : pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += (4 - pos % 4) % 4
        pos += filesize
        pos += (4 - pos % 4) % 4
        if name == "TRAILER!!!":
            # Archives may be concatenated (the kernel accepts that).
            while pos < len(data) and data[pos] == 0:
                pos += 1
            continue
        names.append(name)
    return names
