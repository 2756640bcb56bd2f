"""The files of a checkpoint folder: every name resolved, checked and opened in one place.

Policy (the README's "Checkpoints" paragraph says the same):

* Names that come from inside the checkpoint (the shard index's file names) must be
  plain file names: no `/`, no `..`, not absolute. A name never leaves the folder.
* Only regular files are opened. A FIFO, a device, a socket or a directory named
  like a checkpoint file is refused before anything reads it, and files are opened
  non-blocking with the type checked on the open descriptor, so nothing can hang.
* Symlinks are resolved. A link is followed when its target is a regular file
  inside the folder, or, when the folder is a Hugging Face hub snapshot
  (`.../snapshots/<revision>`), inside that repository's `blobs` folder, which
  is where the hub cache keeps every file. A link to anywhere else is refused,
  so a checkpoint cannot make the loader read a file the user did not hand it.
* JSON files are read whole up to `MAX_JSON_BYTES`; larger ones are refused.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any

# The shard index of a 671B-parameter model (about 90,000 tensors) is under 10 MiB.
MAX_JSON_BYTES = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: a bad or unsafe file, or missing, unexpected or mis-shaped tensors.

    The message names the file (and the tensor or field) at fault.
    """


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: Path, label: str | None = None) -> FileIO:
    """Open `path` for reading only if it is a regular file (checked on the open descriptor).

    O_NONBLOCK keeps a FIFO swapped in after a check from blocking the open;
    O_NOFOLLOW refuses a symlink swapped in after `CheckpointFolder.resolve`.
    """
    label = label or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{label}: cannot open: {e.strerror}") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{label}: {_file_kind(mode)}, not a regular file; refusing to read it")
    return open(fd, "rb", buffering=0)


def read_exactly(f: FileIO, offset: int, size: int, label: str) -> bytearray:
    """`size` bytes at `offset`; a short file is an error, never a short result."""
    buf = bytearray(size)
    view = memoryview(buf)
    f.seek(offset)
    done = 0
    while done < size:
        # One read(2) returns at most about 2 GiB on Linux, so large tensors take several.
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{label}: file ends after {offset + done} bytes, expected {offset + size}")
        done += n
    return buf


def read_json_file(path: Path, *, error: type[ValueError] = CheckpointError, label: str | None = None) -> Any:
    """The JSON value of a regular file of at most MAX_JSON_BYTES; `error` names the file."""
    label = label or str(path)
    with open_regular(path, label) as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise error(f"{label}: over {MAX_JSON_BYTES} bytes; refusing to parse it as JSON")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{label}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise error(f"{label}: JSON nested too deeply") from None
    except ValueError as e:  # json.JSONDecodeError, or an integer of too many digits
        raise error(f"{label}: not valid JSON: {e}") from None


@dataclass(frozen=True, slots=True)
class CheckpointFolder:
    """A checkpoint folder, resolved; `allowed` are the folders symlinks may lead into."""

    root: Path
    allowed: tuple[Path, ...]

    @staticmethod
    def at(path: Path) -> CheckpointFolder:
        try:
            root = path.resolve(strict=True)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot resolve the folder: {e}") from e
        if not root.is_dir():
            raise CheckpointError(f"{path}: not a folder")
        allowed = [root]
        if root.parent.name == "snapshots":  # a hub cache repository: <repo>/snapshots/<rev> -> <repo>/blobs
            allowed.append((root.parent.parent / "blobs").resolve())
        return CheckpointFolder(root=root, allowed=tuple(allowed))

    def label(self, name: str) -> str:
        return str(self.root / name)

    def has(self, name: str) -> bool:
        """Whether the folder has an entry `name` (of any kind: `resolve` judges it)."""
        return os.path.lexists(self.root / name)

    def names(self) -> list[str]:
        """The folder's entry names, sorted."""
        return sorted(os.listdir(self.root))

    def resolve(self, name: Any, *, named_by: str = "") -> Path:
        """The regular file that the entry `name` of this folder is, or leads to by symlinks.

        named_by: where the name came from (a file and field), for the error message.
        Raises CheckpointError for a name that is not a plain file name, a missing
        entry, a link out of the allowed folders, or anything but a regular file.
        """
        where = f"{named_by}: " if named_by else ""
        if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
                or "\0" in name or os.path.isabs(name)):
            raise CheckpointError(f"{where}file name {name!r} is not a plain file name inside {self.root}")
        entry = self.root / name
        try:
            target = entry.resolve(strict=True)
        except FileNotFoundError:
            raise CheckpointError(f"{where}{entry}: no such file (or a symlink to nothing)") from None
        except (OSError, RuntimeError) as e:  # a symlink loop, a permission error
            raise CheckpointError(f"{where}{entry}: cannot resolve: {e}") from e
        if not any(target.is_relative_to(folder) for folder in self.allowed):
            raise CheckpointError(
                f"{where}{entry} is a symlink to {target}, outside the checkpoint folder "
                "(symlinks may lead only into the folder, or into a hub cache's blobs folder)"
            )
        mode = target.stat().st_mode
        if not stat.S_ISREG(mode):
            shown = entry if target == entry else f"{entry} (-> {target})"
            raise CheckpointError(f"{where}{shown}: {_file_kind(mode)}, not a regular file; refusing to read it")
        return target

    def open(self, name: str, *, named_by: str = "") -> FileIO:
        return open_regular(self.resolve(name, named_by=named_by), self.label(name))

    def read_json(self, name: str, *, error: type[ValueError] = CheckpointError) -> Any:
        return read_json_file(self.resolve(name), error=error, label=self.label(name))

    def read_text(self, name: str, limit: int) -> str:
        """A UTF-8 text file of at most `limit` bytes."""
        with self.open(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise CheckpointError(f"{self.label(name)}: over {limit} bytes")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.label(name)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
