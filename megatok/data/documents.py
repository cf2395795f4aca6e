"""Reading raw input files into documents.

The model is byte-level, so a document is just bytes plus a little metadata. The formats, by file name:

- ``.txt``, ``.txt.gz``, ``.txt.zst``: one file = one document, read as raw bytes;
- ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, and ``.json.gz``, ``.json.zst`` (Dolma's names): JSON lines,
  one object per line (Dolma, RedPajama);
- ``.parquet``: one row per document (FineWeb; the Hugging Face hub cache's files);
- ``.arrow``: Arrow IPC, one row per document (``datasets.save_to_disk`` directories, the ``datasets``
  cache).

The text, lang and domain of a record are read from the fields :class:`Fields` names (by default
"text", "lang", "domain"); a dotted name reaches into a nested object or struct column
("metadata.language") when no field has the dotted name itself. Anything malformed stops the build with
a DataError that names the file and the line or row: a silently skipped line is a silently shifted
dataset.

A file is read in one or more :class:`Unit` s (a large parquet file in ranges of row groups), so that a
build can read the units in parallel processes and still number the documents as one reader would.
"""

import gzip
import io
import json
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES
#: a parquet file larger than this on disk is read in ranges of row groups of about this size (uncompressed)
UNIT_BYTES = 64 << 20


class DataError(Exception):
    """A problem with input data or shards; the message is one line naming the file (and line)."""


@dataclass
class Document:
    text: bytes  # raw bytes; non-UTF-8 is fine, the model reads bytes
    lang: str | None
    domain: str | None
    # "path/to/file.jsonl:17" (line 17), "file.parquet:row17" (row 17, from 0), "file.txt", or
    # "file.txt#2" for the third piece of a split file
    source: str
    piece: int = 0  # which piece of a split input document this is (0: the first, or the whole document)


@dataclass(frozen=True)
class Fields:
    """Where a record keeps its text and metadata: JSON keys or table columns, dotted for nested ones."""
    text: str = "text"
    lang: str = "lang"
    domain: str = "domain"


@dataclass(frozen=True)
class Unit:
    """A part of an input file that one reader reads: the whole file, or (parquet) row groups
    ``[row_groups[0], row_groups[1])``."""
    path: str
    row_groups: tuple[int, int] | None = None


def list_input_files(paths: list[str], warn: bool = True, seen: set[str] | None = None) -> list[str]:
    """Expand input paths into the list of files to read, in a stable (sorted) order.

    Directories are walked recursively (symbolic links followed, each directory once) and files
    with unsupported suffixes inside them are ignored, as are ``cache-*.arrow`` files (the ``datasets``
    library's results of ``map``/``filter``, which would repeat the data beside them); an unsupported
    file named explicitly is an error, because the user asked for it. A file reached twice (named inside a directory also given,
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
                found += [os.path.join(root, n) for n in sorted(names) if _wanted(n)]
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


def _wanted(name: str) -> bool:
    return name.endswith(SUFFIXES) and not (name.startswith("cache-") and name.endswith(ARROW_SUFFIXES))


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
    """A binary stream of the file's bytes, decompressed for .gz and .zst."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(path), 1 << 20)
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file, frame after frame (pzstd and concatenated files hold
    several). zstandard's stream_reader ends quietly where a cut file ends, which would drop the rest
    of a document set without a word; this reader raises ZstdError when the file ends inside a frame."""

    def __init__(self, path: str):
        import zstandard

        self._raw = open(path, "rb")
        self._zstd = zstandard
        # a window up to 2 GiB reads files compressed with --long
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._frame = None
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._raw.read(1 << 20)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise self._zstd.ZstdError("the file ends inside a frame (cut short?)")
                return 0
            parts = []
            while data:
                if self._frame is None or self._frame.eof:
                    self._frame = self._dctx.decompressobj()
                parts.append(self._frame.decompress(data))
                data = self._frame.unused_data if self._frame.eof else b""
            self._out, self._pos = b"".join(parts), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a corrupt compressed file raises while it is read."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    if "zstandard" in sys.modules:
        errors += (sys.modules["zstandard"].ZstdError,)
    return errors


def _unreadable(path: str, exn: BaseException) -> DataError:
    what = ("corrupt gzip file" if path.endswith(".gz") else "corrupt zstd file" if path.endswith(".zst")
            else "cannot read file")
    detail = str(exn).replace("\n", " ") or type(exn).__name__
    return DataError(f"{path}: {what}: {detail}")


def _read_file(path: str) -> bytes:
    """The whole file as bytes (decompressed for .gz and .zst)."""
    try:
        with _open(path) as f:
            return f.read()
    except _read_errors() as exn:
        raise _unreadable(path, exn) from None


def _read_lines(path: str) -> Iterator[bytes]:
    try:
        with _open(path) as f:
            yield from f
    except _read_errors() as exn:
        raise _unreadable(path, exn) from None


def _lookup(obj: dict, name: str):
    """obj[name], or for a dotted name that is no key, the nested value (None where a level is missing)."""
    if name in obj or "." not in name:
        return obj.get(name)
    for part in name.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _optional_str(obj: dict, field: str, default: str | None, where: str) -> str | None:
    value = _lookup(obj, field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise DataError(f'{where}: "{field}" must be a string, got {type(value).__name__}')
    return value


def _jsonl_records(path: str, fields: Fields, lang: str | None, domain: str | None):
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
        text = _lookup(obj, fields.text)
        if text is None and fields.text not in obj:
            raise DataError(f'{where}: missing "{fields.text}" field')
        if not isinstance(text, str):
            raise DataError(f'{where}: "{fields.text}" must be a string, got {type(text).__name__}')
        # surrogatepass: a lone surrogate from a sloppy scraper becomes bytes instead of failing the build
        yield (text.encode("utf-8", "surrogatepass"), _optional_str(obj, fields.lang, lang, where),
               _optional_str(obj, fields.domain, domain, where), where)


# ----------------------------------------------------------------------------- parquet and Arrow


def _arrow_errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    return (pa.ArrowException, OSError, EOFError)


def _table_problem(path: str, kind: str, exn: BaseException) -> DataError:
    detail = " ".join(str(exn).split()) or type(exn).__name__
    return DataError(f"{path}: not a readable {kind} file: {detail}")


def _parquet_file(path: str):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, memory_map=True)
    except _arrow_errors() as exn:
        raise _table_problem(path, "parquet", exn) from None


def _columns(path: str, names: list[str], fields: Fields) -> list[str]:
    """The top-level columns to read for the fields; a missing text column is an error naming the file."""
    out = []
    for name in (fields.text, fields.lang, fields.domain):
        top = name if name in names else name.split(".")[0]
        if top in names:
            out.append(top)
        elif name == fields.text:
            raise DataError(f'{path}: no "{fields.text}" column (columns: {", ".join(names)})')
    return list(dict.fromkeys(out))


def _column(path: str, batch, name: str):
    """The named column of a record batch (a dotted name reaches into struct columns), or None where
    there is none (as a JSON object without the key)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = batch.schema.names
    if name in names:
        return batch.column(names.index(name))
    parts = name.split(".")
    if parts[0] not in names:
        return None
    col = batch.column(names.index(parts[0]))
    for part in parts[1:]:
        if not pa.types.is_struct(col.type) or col.type.get_field_index(part) < 0:
            return None
        col = pc.struct_field(col, [col.type.get_field_index(part)])
    return col


def _strings(path: str, batch, name: str, binary: bool):
    """The column's values as a list (bytes with ``binary``, else str; None for nulls), or None if absent."""
    import pyarrow as pa

    col = _column(path, batch, name)
    if col is None:
        return None
    t = col.type
    if pa.types.is_null(t):
        return [None] * len(col)
    if binary and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        col = col.cast(pa.large_binary())  # the UTF-8 bytes as they are: no decode and encode again
    elif not (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)
              or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise DataError(f'{path}: column "{name}" must hold strings, it holds {t}')
    values = col.to_pylist()
    if not binary and values and not isinstance(next((v for v in values if v is not None), ""), str):
        raise DataError(f'{path}: column "{name}" must hold strings, it holds {t}')
    return values


def _batch_records(path: str, batch, first_row: int, fields: Fields, lang: str | None, domain: str | None):
    texts = _strings(path, batch, fields.text, binary=True)
    if texts is None:
        raise DataError(f'{path}: no "{fields.text}" column (columns: {", ".join(batch.schema.names)})')
    langs = _strings(path, batch, fields.lang, binary=False) or [None] * len(texts)
    domains = _strings(path, batch, fields.domain, binary=False) or [None] * len(texts)
    for k, (text, doc_lang, doc_domain) in enumerate(zip(texts, langs, domains)):
        where = f"{path}:row{first_row + k}"
        if text is None:
            raise DataError(f'{where}: "{fields.text}" is null')
        yield text, lang if doc_lang is None else doc_lang, domain if doc_domain is None else doc_domain, where


def _guarded(path: str, kind: str, batches: Iterator) -> Iterator:
    """The batches, with a reading error (a corrupt page, a cut file) turned into one DataError line."""
    errors = _arrow_errors()
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except errors as exn:
            raise _table_problem(path, kind, exn) from None
        yield batch


def _parquet_records(unit: Unit, fields: Fields, lang: str | None, domain: str | None):
    path = unit.path
    pf = _parquet_file(path)
    meta = pf.metadata
    first, stop = unit.row_groups or (0, meta.num_row_groups)
    row = sum(meta.row_group(i).num_rows for i in range(first))
    columns = _columns(path, pf.schema_arrow.names, fields)
    if stop <= first:
        return
    batches = pf.iter_batches(batch_size=4096, row_groups=range(first, stop), columns=columns, use_threads=False)
    for batch in _guarded(path, "parquet", batches):
        yield from _batch_records(path, batch, row, fields, lang, domain)
        row += batch.num_rows


def _arrow_records(unit: Unit, fields: Fields, lang: str | None, domain: str | None):
    """An Arrow IPC file: the stream format that ``datasets`` writes, or the file format."""
    import pyarrow as pa

    path = unit.path
    try:
        source = pa.memory_map(path)
        try:
            stream = pa.ipc.open_stream(source)
            schema, batches = stream.schema, iter(stream)
        except pa.ArrowInvalid:
            file = pa.ipc.open_file(source)
            schema, batches = file.schema, (file.get_batch(i) for i in range(file.num_record_batches))
    except _arrow_errors() as exn:
        raise _table_problem(path, "Arrow", exn) from None
    _columns(path, schema.names, fields)
    row = 0
    for batch in _guarded(path, "Arrow", batches):
        yield from _batch_records(path, batch, row, fields, lang, domain)
        row += batch.num_rows


# ----------------------------------------------------------------------------- units and documents


def units_of(files: Iterable[str], unit_bytes: int | None = None) -> list[Unit]:
    """The units to read the files in, in order: a parquet file larger than ``unit_bytes`` (default
    UNIT_BYTES) on disk in consecutive ranges of row groups of about ``unit_bytes`` uncompressed; any
    other file whole."""
    unit_bytes = UNIT_BYTES if unit_bytes is None else unit_bytes
    out = []
    for path in files:
        if not (path.endswith(PARQUET_SUFFIXES) and os.path.getsize(path) > unit_bytes):
            out.append(Unit(path))
            continue
        meta = _parquet_file(path).metadata
        start, size = 0, 0
        for i in range(meta.num_row_groups):
            size += meta.row_group(i).total_byte_size
            if size >= unit_bytes or i == meta.num_row_groups - 1:
                out.append(Unit(path, (start, i + 1)))
                start, size = i + 1, 0
        if meta.num_row_groups == 0:
            out.append(Unit(path))
    return out


def unit_records(unit: Unit, fields: Fields = Fields(), lang: str | None = None, domain: str | None = None):
    """Yield (text bytes, lang, domain, source) for each record of a unit; lang/domain fill in for
    records without them."""
    path = unit.path
    if path.endswith(PARQUET_SUFFIXES):
        return _parquet_records(unit, fields, lang, domain)
    if path.endswith(ARROW_SUFFIXES):
        return _arrow_records(unit, fields, lang, domain)
    if path.endswith(JSONL_SUFFIXES):
        return _jsonl_records(path, fields, lang, domain)
    return iter([(_read_file(path), lang, domain, path)])


def unit_documents(unit: Unit, *, fields: Fields = Fields(), lang: str | None = None, domain: str | None = None,
                   max_doc_bytes: int = 1 << 20, stats: dict | None = None) -> Iterator[Document]:
    """The documents of one unit: records split at max_doc_bytes, empty ones skipped (see iter_documents)."""
    stats = {} if stats is None else stats
    for key in ("documents", "bytes", "empty_documents", "split_documents"):
        stats.setdefault(key, 0)
    for text, doc_lang, doc_domain, source in unit_records(unit, fields, lang, domain):
        if not text:
            stats["empty_documents"] += 1
            continue
        pieces = split_text(text, max_doc_bytes) if len(text) > max_doc_bytes else [text]
        if len(pieces) > 1:
            stats["split_documents"] += 1
        for k, piece in enumerate(pieces):
            stats["documents"] += 1
            stats["bytes"] += len(piece)
            yield Document(piece, doc_lang, doc_domain, source if len(pieces) == 1 else f"{source}#{k}", k)


def iter_documents(paths: list[str], *, lang: str | None = None, domain: str | None = None,
                   max_doc_bytes: int = 1 << 20, stats: dict | None = None,
                   seen: set[str] | None = None, fields: Fields = Fields()) -> Iterator[Document]:
    """Yield the documents of the input paths in a deterministic order.

    lang/domain fill the metadata of .txt files and of records that lack it; ``fields`` names the
    text, lang and domain fields of JSON lines, parquet and Arrow records. Documents longer than
    max_doc_bytes are split (see split_text) so no single sample can blow up a shard or a reader's
    memory. Empty documents are skipped. Counts go into stats if given: "documents" (yielded, after
    splitting), "bytes", "empty_documents", "split_documents" (inputs that were split).
    """
    if max_doc_bytes < 1:
        raise ValueError(f"max_doc_bytes must be positive, got {max_doc_bytes}")
    stats = {} if stats is None else stats
    for key in ("documents", "bytes", "empty_documents", "split_documents"):
        stats.setdefault(key, 0)
    for path in list_input_files(paths, warn=False, seen=seen):  # the tools list the inputs first, which warns
        for unit in units_of([path]):
            yield from unit_documents(unit, fields=fields, lang=lang, domain=domain, max_doc_bytes=max_doc_bytes,
                                      stats=stats)
