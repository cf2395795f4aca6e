"""Reading raw input files into documents.

The model is byte-level, so a document is just bytes plus a little metadata. Inputs are plain
text files (one file = one document) and JSON-lines files (one object per line with a "text"
field), optionally gzipped. Anything malformed stops the build with a DataError that names the
file and, for JSON lines, the line number: a silently skipped line is a silently shifted
dataset.
"""

import gzip
import json
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Iterator

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES


class DataError(Exception):
    """A problem with input data or shards; the message is one line naming the file (and line)."""


@dataclass
class Document:
    text: bytes  # raw bytes; non-UTF-8 is fine, the model reads bytes
    lang: str | None
    domain: str | None
    source: str  # "path/to/file.jsonl:17", "file.txt", or "file.txt#2" for the third piece of a split file
    piece: int = 0  # which piece of a split input document this is (0: the first, or the whole document)


def list_input_files(paths: list[str], warn: bool = True, seen: set[str] | None = None) -> list[str]:
    """Expand input paths into the list of files to read, in a stable (sorted) order.

    Directories are walked recursively (symbolic links followed, each directory once) and files
    with unsupported suffixes inside them are ignored; an unsupported file named explicitly is an
    error, because the user asked for it. A file reached twice (named inside a directory also given,
    or through a link) is read once, at its first place, with a warning (``warn``). ``seen`` (real
    paths, updated) carries that over several calls, for a caller that reads its paths one by one.
    """
    if isinstance(paths, str):
        paths = [paths]
    files, seen_files, seen_dirs, twice = [], set() if seen is None else seen, set(), []

    def add(file):
        real = os.path.realpath(file)
        if real in seen_files:
            twice.append(file)
        else:
            seen_files.add(real)
            files.append(file)

    for path in paths:
        if os.path.isdir(path) and os.path.realpath(path) in seen_dirs:
            twice.append(path)  # a directory already walked, under this name or another
        elif os.path.isdir(path):
            found, pruned = [], False
            for root, dirs, names in os.walk(path, followlinks=True):
                seen_dirs.add(os.path.realpath(root))
                kept = sorted(d for d in dirs if os.path.realpath(os.path.join(root, d)) not in seen_dirs)
                pruned |= len(kept) < len(dirs)
                dirs[:] = kept
                found += [os.path.join(root, n) for n in sorted(names) if n.endswith(SUFFIXES)]
            if pruned and not found:  # everything in it was reached already (raw/sub raw)
                twice.append(path)
            elif not found:
                raise DataError(f"{path}: directory contains no {', '.join(SUFFIXES)} files")
            for file in found:
                add(file)
        elif os.path.exists(path):
            if not path.endswith(SUFFIXES):
                raise DataError(f"{path}: unsupported file type (expected one of {', '.join(SUFFIXES)})")
            add(path)
        else:
            raise DataError(f"{path}: no such file or directory")
    if twice and warn:
        print(f"megatok: warning: {len(twice)} input(s) reached twice, read once: {', '.join(twice[:3])}"
              f"{' ...' if len(twice) > 3 else ''}", file=sys.stderr, flush=True)
    return files


def split_text(text: bytes, max_bytes: int) -> list[bytes]:
    """Split text into pieces of at most max_bytes, each ending at its last newline if it has one.

    Cutting at a newline keeps lines whole where possible; the pieces concatenate back to the
    original bytes exactly.
    """
    pieces, start = [], 0
    while len(text) - start > max_bytes:
        newline = text.rfind(b"\n", start, start + max_bytes)
        end = newline + 1 if newline >= 0 else start + max_bytes
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _unreadable(path: str, exn: BaseException) -> DataError:
    what = "corrupt gzip file" if path.endswith(".gz") else "cannot read file"
    detail = str(exn).replace("\n", " ") or type(exn).__name__
    return DataError(f"{path}: {what}: {detail}")


def _read_file(path: str) -> bytes:
    """The whole file as bytes (decompressed for .gz)."""
    try:
        with _open(path) as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as exn:
        raise _unreadable(path, exn) from None


def _read_lines(path: str) -> Iterator[bytes]:
    try:
        with _open(path) as f:
            yield from f
    except (OSError, EOFError, zlib.error) as exn:
        raise _unreadable(path, exn) from None


def _optional_str(obj: dict, field: str, default: str | None, where: str) -> str | None:
    value = obj.get(field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise DataError(f'{where}: "{field}" must be a string, got {type(value).__name__}')
    return value


def _jsonl_records(path: str, lang: str | None, domain: str | None):
    """Yield (text bytes, lang, domain, source) for each line of a JSON-lines file; blank lines are skipped."""
    for lineno, line in enumerate(_read_lines(path), 1):
        if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte order mark
            line = line[3:]
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as exn:  # JSONDecodeError and UnicodeDecodeError
            raise DataError(f"{where}: invalid JSON: {exn}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if "text" not in obj:
            raise DataError(f'{where}: missing "text" field')
        text = obj["text"]
        if not isinstance(text, str):
            raise DataError(f'{where}: "text" must be a string, got {type(text).__name__}')
        # surrogatepass: a lone surrogate from a sloppy scraper becomes bytes instead of failing the build
        yield (text.encode("utf-8", "surrogatepass"), _optional_str(obj, "lang", lang, where),
               _optional_str(obj, "domain", domain, where), where)


def iter_documents(paths: list[str], *, lang: str | None = None, domain: str | None = None,
                   max_doc_bytes: int = 1 << 20, stats: dict | None = None,
                   seen: set[str] | None = None) -> Iterator[Document]:
    """Yield the documents of the input paths in a deterministic order.

    lang/domain fill the metadata of .txt files and of JSON lines that lack it. Documents longer
    than max_doc_bytes are split (see split_text) so no single sample can blow up a shard or a
    reader's memory. Empty documents are skipped. Counts go into stats if given: "documents"
    (yielded, after splitting), "bytes", "empty_documents", "split_documents" (inputs that were split).
    """
    if max_doc_bytes < 1:
        raise ValueError(f"max_doc_bytes must be positive, got {max_doc_bytes}")
    stats = {} if stats is None else stats
    for key in ("documents", "bytes", "empty_documents", "split_documents"):
        stats.setdefault(key, 0)
    for path in list_input_files(paths, warn=False, seen=seen):  # the tools list the inputs first, which warns
        if path.endswith(JSONL_SUFFIXES):
            records = _jsonl_records(path, lang, domain)
        else:
            records = [(_read_file(path), lang, domain, path)]
        for text, doc_lang, doc_domain, source in records:
            if not text:
                stats["empty_documents"] += 1
                continue
            pieces = split_text(text, max_doc_bytes)
            if len(pieces) > 1:
                stats["split_documents"] += 1
            for k, piece in enumerate(pieces):
                stats["documents"] += 1
                stats["bytes"] += len(piece)
                yield Document(piece, doc_lang, doc_domain, source if len(pieces) == 1 else f"{source}#{k}", k)
