"""Writing the files a user asked for (plans, profiles, run reports, CSV, HTML): checked up front,
written atomically.

`check_output_path` refuses, before any expensive work, a path that cannot become the file: a
directory, a missing or unwritable parent directory, or an existing file without --force.
`atomic_write_text` / `atomic_open` write to a temporary file in the same directory and rename it
over the target (`os.replace`), so an interrupted or failed write never leaves a truncated file
where a good one was. Failures are one line (`BadInput`, exit code 2) naming the path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import IO, Iterator


def _flag(flag: str | None) -> str:
    return f" ({flag})" if flag else ""


def _target(path: str | Path) -> Path:
    """Where the bytes go: `path` with ~ expanded, through a symbolic link (as open() follows it)."""
    p = Path(path).expanduser()
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def check_output_path(path: str | Path, *, force: bool = False, flag: str | None = None) -> Path:
    """The file `path` may be written: not a directory, its parent an existing writable directory,
    and absent unless `force`. BadInput (one line naming the path and `flag`) otherwise."""
    from planner.errors import BadInput

    shown = str(path)
    target = _target(path)
    if target.is_dir():
        raise BadInput(f"{shown}: is a directory{_flag(flag)}; give a file name")
    if target.exists() and not force:
        raise BadInput(f"{shown}: already exists{_flag(flag)}; pass --force to overwrite it")
    parent = target.parent
    if not parent.exists():
        raise BadInput(f"{parent}: no such directory{_flag(flag)}")
    if not parent.is_dir():
        raise BadInput(f"{parent}: not a directory{_flag(flag)}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"{parent}: directory not writable{_flag(flag)}")
    return target


@contextlib.contextmanager
def atomic_open(path: str | Path, *, encoding: str = "utf-8", newline: str | None = None) -> Iterator[IO[str]]:
    """A text file to write `path` through: a temporary file beside it that replaces `path` when
    the block ends without an exception (and is removed when it raises). The file gets the mode
    `path` had, or the umask's default for a new file, as open(path, "w") would give it."""
    from planner.errors import BadInput

    shown = str(path)
    target = _target(path)
    if target.is_dir():
        raise BadInput(f"{shown}: is a directory; give a file name")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise BadInput(f"{shown}: cannot write it: {exc.strerror or exc}") from exc
    done = False
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            os.chmod(tmp, target.stat().st_mode & 0o7777)  # keep an overwritten file's mode
        os.replace(tmp, target)
        done = True
    except OSError as exc:
        raise BadInput(f"{shown}: cannot write it: {exc.strerror or exc}") from exc
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def atomic_write_text(path: str | Path, text: str, *, encoding: str = "utf-8", newline: str | None = None) -> Path:
    """Write `text` to `path` atomically (see atomic_open); returns the path."""
    with atomic_open(path, encoding=encoding, newline=newline) as f:
        f.write(text)
    return Path(path)
