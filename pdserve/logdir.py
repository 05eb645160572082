"""`pdserve up`'s log folder: private to the user who runs the cluster.

The folder holds the cluster token and every process's log, so nobody else may read it or
plant files in it. `private_dir` creates it with mode 0700 or accepts an existing one only
if this user owns it and nobody else has any access (a folder someone else prepared could
hold a token file they can read, or a link to a file of ours). `private_file` creates a
file there fresh (O_EXCL, O_NOFOLLOW, mode 0600): a file already at that name is removed
first, never written into, so a pre-planted file keeps none of what is written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class LogDirError(ValueError):
    """The log folder cannot be used safely; the message says why and what to do."""


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can use: created 0700, or checked if it exists."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        _check_existing(path)
    else:
        os.chmod(path, 0o700)  # mkdir's mode is narrowed by the umask, never widened
    return path


def _check_existing(path: Path) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise LogDirError(f"--log-dir {path} exists and is not a folder")
    if st.st_uid != os.getuid():
        raise LogDirError(
            f"--log-dir {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
            "the cluster token would be stored where someone else controls it; give a new path"
        )
    if st.st_mode & 0o077:
        raise LogDirError(
            f"--log-dir {path} has mode {stat.S_IMODE(st.st_mode):o}: others could read the "
            f"cluster token or plant files; `chmod 700 {path}` or give a new path"
        )


def private_file(path: Path, append: bool = False) -> int:
    """A file descriptor of `path` opened for writing, mode 0600. Appending reopens a file
    this process made (a restarted child's log); otherwise any existing file is removed
    and a new one created exclusively."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    if append:
        return os.open(path, flags | os.O_APPEND | os.O_CREAT, 0o600)
    path.unlink(missing_ok=True)
    return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
