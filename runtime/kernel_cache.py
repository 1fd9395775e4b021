"""Where generated kernel sources are written before Triton imports them, and the checks that make
sure the file imported is the one usc generated.

Triton reads a kernel's source from a file, so every fused kernel is written to disk and imported
from there. A file in a directory another user can write is code that user chooses, so:

- the directory is private: ``$USC_KERNEL_CACHE`` when set, else ``$XDG_CACHE_HOME/usc/kernels``
  (``~/.cache/usc/kernels``), created with mode 0700; an existing directory must be owned by this
  user and writable by nobody else, or it is refused with :class:`KernelCacheError`;
- a cached file is used only when its bytes equal the source this process generated (the name is
  the source's hash, the content is checked, not trusted); anything else is rewritten atomically.
"""

from __future__ import annotations

import os
import stat
import threading


class KernelCacheError(RuntimeError):
    """The kernel cache directory is not private to this user: no kernel is imported from it."""


def cache_directory() -> str:
    """The directory kernels are written to (created private if missing, checked if present)."""
    folder = os.environ.get("USC_KERNEL_CACHE")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "usc", "kernels")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    check_private(folder)
    return folder


def check_private(folder: str) -> None:
    """Refuse a directory that is a symlink, not owned by this user, or writable by group/others."""
    info = os.lstat(folder)
    fix = (f"use a directory only you can write: `mkdir -m 700 DIR` and set USC_KERNEL_CACHE=DIR, "
           f"or remove {folder!r}")
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise KernelCacheError(f"kernel cache {folder!r} is not a plain directory (a link?); {fix}")
    if info.st_uid != os.getuid():
        raise KernelCacheError(f"kernel cache {folder!r} belongs to user id {info.st_uid}, not to this user "
                               f"({os.getuid()}): its files would run inside this job; {fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelCacheError(f"kernel cache {folder!r} is writable by other users "
                               f"(mode {stat.S_IMODE(info.st_mode):o}); {fix}")


def kernel_file(name: str, source: str) -> str:
    """The path of ``name``'s source in the private cache, holding exactly ``source``."""
    path = os.path.join(cache_directory(), f"{name}.py")
    if _holds(path, source):
        return path
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
    return path


def _holds(path: str, source: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == source
    except (OSError, UnicodeDecodeError):
        return False
