"""Validation of the repository-relative paths task rows and sandboxes accept."""

from __future__ import annotations

import posixpath


def repo_relative(path: str) -> str:
    """Normalises `path` and checks it stays inside the repository root.

    Raises ValueError for absolute paths, empty paths and paths that climb out with `..`.
    """
    if not path or "\x00" in path:
        raise ValueError(f"invalid file path {path!r}")
    if posixpath.isabs(path):
        raise ValueError(f"file path must be relative to the repository root, got {path!r}")
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../"):
        raise ValueError(f"file path {path!r} leaves the repository root")
    if norm == ".":
        raise ValueError(f"file path {path!r} names the repository root, not a file")
    return norm
