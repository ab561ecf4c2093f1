"""Files a user names: the one reader of every file input (a job's config, plan profiles and
overheads), bounded so that no input can hold a command up or exhaust its memory, and the one
check that an output folder can be written before any work (:func:`writable_folder`).

A path may name anything: ``/dev/zero`` never ends, a FIFO blocks, a 20-GB log fills memory.
:func:`read_small_file` reads only a regular file, and at most its cap, and says which bound
was hit, as a :class:`~timeslice.errors.InvalidArgumentError` (the CLI's exit status 2).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from timeslice.errors import InvalidArgumentError

__all__ = ["MAX_INPUT_BYTES", "ensure_writable_dir", "read_small_file", "writable_folder"]

# The most any file input may hold: a job config, a profile file (many jobs' profiles) and an
# overheads file are kilobytes each.
MAX_INPUT_BYTES = 4 << 20


def read_small_file(path: Path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of the regular file at ``path``, at most ``max_bytes`` long.

    Args:
        path: the file the user named.
        what: how messages name it (a flag, ``"--config"``, or ``"profile"``).
        max_bytes: the most it may hold.

    Returns:
        Its text.

    Raises:
        InvalidArgumentError: it cannot be read, is not a regular file (a device, a FIFO, a
            folder), is larger than ``max_bytes``, or is not UTF-8 text.
    """
    try:
        # Opened without blocking (a FIFO with no writer would wait forever) and checked
        # through the descriptor, so the file checked is the one read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidArgumentError(
                f"{what} {path}: not a regular file (a device, a pipe or a folder); give a file"
            )
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise InvalidArgumentError(f"{what} {path}: cannot read ({err.strerror})") from None
    if len(data) > max_bytes:
        raise InvalidArgumentError(
            f"{what} {path}: larger than {max_bytes} bytes, more than any such file holds"
        )
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise InvalidArgumentError(f"{what} {path}: not UTF-8 text ({err})") from None


def ensure_writable_dir(path: Path) -> None:
    """Create the folder ``path`` if needed and check a file can be written in it; OSError
    (with its strerror) if not."""
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
        pass


def writable_folder(path: Path, flag: str) -> None:
    """Check, before any work, that files can be written in the folder ``path`` a user named
    with ``flag``; InvalidArgumentError saying so if not."""
    try:
        ensure_writable_dir(path)
    except OSError as err:
        raise InvalidArgumentError(
            f"{flag} {path}: cannot write there ({err.strerror}); pick a writable folder"
        ) from None
