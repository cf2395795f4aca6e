"""Document inputs given on a command line or in ``eval.heldout``: files and directories of them (the
formats build_shards reads), or shard sets, in one list. One reader, so every tool takes the same inputs
by the same rules."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from megatok.data.documents import Document, iter_documents
from megatok.data.stream import iter_shard_documents, resolve_shards


def is_shards(path: str) -> bool:
    """A shard set: a shard directory (it has a manifest), a tar, a brace pattern of tars or a URL; not a
    document file (a document file whose directory name says ".tar" is still a document file)."""
    if Path(path, "manifest.json").is_file() or path.startswith("pipe:") or "://" in path:
        return True
    return path.endswith(".tar") or ("{" in path and ".tar" in path)


def read_documents(paths: str | Iterable[str], split: str) -> Iterator[Document]:
    """The documents of ``paths`` in order: a shard set's ``split`` ("train" or "val"), every document of
    a file or directory (files have no splits). A file reached twice (inside a directory also given,
    through a link) is read once."""
    seen: set[str] = set()
    for p in [paths] if isinstance(paths, str) else paths:
        p = str(p)
        if is_shards(p):
            yield from iter_shard_documents(resolve_shards(p, split))
        else:
            yield from iter_documents([p], seen=seen)
