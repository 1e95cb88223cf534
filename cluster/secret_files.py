"""Files that hold a secret (the cluster token, etcd passwords, TLS material): read once at
start with errors that name the flag, written readable by their owner alone.

Stdlib only: the router and `pdserve --help` import it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def read_secret_file(source: str, path: str) -> bytes:
    """The bytes of `path`; ValueError naming `source` (the flag and path) when the file
    cannot be read or holds only whitespace."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{source}: cannot read it ({exc.strerror})") from None
    if not data.strip():
        raise ValueError(f"{source}: the file is empty")
    return data


def write_secret_file(path: Path, text: str, *, exclusive: bool = False) -> Path:
    """Write `text` and a newline to `path`, created 0600 (never readable by others, not even
    for a moment); `exclusive`: refuse to overwrite an existing file. Returns `path`."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def with_absolute_paths(config: T, *not_paths: str) -> T:
    """`config` (a frozen dataclass of optional file paths) with every path given made
    absolute, for a child process started elsewhere; `not_paths`: fields that are not paths
    (a user name, a server name)."""
    return dataclasses.replace(
        config,
        **{
            f.name: str(Path(getattr(config, f.name)).resolve())
            for f in dataclasses.fields(config)
            if f.name not in not_paths and getattr(config, f.name)
        },
    )
