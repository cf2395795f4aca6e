"""Streaming shards into packed byte batches for training.

Each (rank, dataloader worker) pair is one reader. Every epoch the shard list is shuffled the
same way on all ranks and reader r of R reads shards[r::R], so each document is read exactly
once per epoch across the job. A reader turns its documents into one continuous token stream
(bytes, or BPE ids: see megatok.data.encoding), a separator before every document, and cuts it into sequences of seq_len + 1 tokens that overlap by one
token, so every token is a prediction target exactly once. The stream never ends: ranks that
own more data simply reach the next epoch later, and no rank ever waits for another.

A mixture (``data.shards`` = {shard spec: weight}) gives each reader one such document stream per
source, every source with its own epochs, and takes its next document from the source furthest
below its share of the bytes it has read (weight / sum of weights): each reader's bytes follow
the weights to within one document (the job's to within one per reader), with no randomness to replay.

Everything a reader produces is a pure function of (urls, weights, seed, seq_len, batch_size,
reader, R), which is what makes resuming exact. Every batch carries its reader's *cursor*: where the
next batch starts (per source: epoch, shard, document, documents read in the epoch; the mixture's
byte counts, the bad shards so far, and the token offset in that document). A reader restarted from
a cursor opens that shard and goes on from there, reading nothing before it; without one it
regenerates and discards what it had produced (start_batch), which reads (and tokenizes) everything again.
"""

import importlib
import json
import os
import signal
import tarfile
import urllib.parse
import warnings
import zlib
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset import shardlists, tariterators
from webdataset.gopen import gopen  # (webdataset.gopen is also the name of the function)

from megatok.data.documents import DataError, Document
from megatok.data.encoding import BYTES
from megatok.data.shards import read_manifest


class BadShardWarning(UserWarning):
    """A shard could not be read completely and was skipped (after the documents read before the damage)."""


def from_run_config(spec, key: str = "data.shards"):
    """``spec`` (``key`` of a run directory's config.json, which a tool reads when no --data is given):
    itself, or a DataError (one line) when it holds a ``pipe:`` command. A tool that reads someone else's
    run (megatok-summarize, megatok-boundary-value, megatok-estimator-variance) runs no command written in
    it unasked; passing the same spec as --data runs it."""
    specs = list(spec) if isinstance(spec, dict) else spec if isinstance(spec, list) else [spec]
    command = next((s for s in specs if isinstance(s, str) and s.strip().startswith("pipe:")), None)
    if command is not None:
        raise DataError(f"{key} of the run's config.json is a command ({command[:80]}); megatok does not run "
                        f"a command read from a run directory: pass the data as --data (the same spec runs it, "
                        f"if you trust it)")
    return spec


def is_local(spec: str) -> bool:
    """A local path, not a URL (pipe:, https:, file:, s3:// ...)."""
    return ":" not in spec.split("/")[0]


def resolve_sources(spec: str | list[str] | dict[str, float], split: str = "train", key: str | None = None
                    ) -> tuple[list[list[str]], list[float] | None]:
    """(shard URLs per source, weights): one source and no weights unless spec is a {spec: weight} mixture.
    ``key``: the config key that gave ``spec`` (data.shards, data.val_shards), named first in an error."""
    try:
        if isinstance(spec, dict):
            return [resolve_shards(s, split) for s in spec], [float(w) for w in spec.values()]
        return [resolve_shards(spec, split)], None
    except DataError as e:
        if key is None:
            raise
        raise DataError(f"{key}: {e}") from None


def validation_sources(shards, val_shards) -> tuple[list[list[str]], list[float] | None]:
    """resolve_sources of the validation data: ``data.val_shards`` if set, else the val split of each
    ``data.shards`` source, which only a shard directory (megatok-build-shards) has. A URL pattern or
    list has none: validating on its training shards would be silent and wrong, so it is an error."""
    if val_shards is not None:
        return resolve_sources(val_shards, "val", key="data.val_shards")
    for source in shards if isinstance(shards, dict) else [shards]:
        if not (isinstance(source, str) and os.path.isdir(source)):
            raise DataError(f"data.shards {source}: URLs and shard lists have no val split; set data.val_shards "
                            f"to the validation shards")
    return resolve_sources(shards, "val", key="data.shards")


def resolve_shards(spec: str | list[str] | dict[str, float], split: str = "train") -> list[str]:
    """Turn a shard directory, a brace pattern ("data/train-{00000..00063}.tar") or a list into shard
    URLs; a mixture ({spec: weight}) gives the URLs of all its sources, in order."""
    if isinstance(spec, dict):
        return [u for s in spec for u in resolve_shards(s, split)]
    if isinstance(spec, str) and os.path.isdir(spec):
        manifest = read_manifest(spec)
        if split not in ("train", "val"):
            raise DataError(f"{spec}: unknown split {split!r} (expected 'train' or 'val')")
        urls = [os.path.join(spec, entry["name"]) for entry in manifest[split]]
        if not urls:
            raise DataError(f"{spec}: manifest lists no {split} shards" + (
                " (rebuild it with megatok-build-shards --val-fraction > 0, or set data.val_shards)"
                if split == "val" else ""))
    else:
        if isinstance(spec, str) and "{" not in spec and is_local(spec) and not os.path.exists(spec):
            raise DataError(f"{spec}: no such shard directory or file (build one with megatok-build-shards)")
        try:
            urls = [u for s in ([spec] if isinstance(spec, str) else spec) for u in shardlists.expand_urls(s)]
        except ValueError as e:  # braceexpand: unbalanced braces
            raise DataError(f"{spec}: not a shard pattern ({e})") from None
        if not urls:
            raise DataError(f"no shards in {spec!r}")
    gopen = importlib.import_module("webdataset.gopen")  # the module; the package exports a function of that name
    schemes = {s for s in gopen.gopen_schemes if s != "__default__"} | {"", "file"}
    for url in urls:
        if is_local(url):
            if not os.path.isfile(url):
                raise DataError(f"{url}: shard file not found")
        # as WebDataset opens it: after its GOPEN_REWRITE rules, the scheme as urlparse reads it
        elif (scheme := urllib.parse.urlparse(gopen.rewrite_url(url)).scheme) not in schemes:
            raise DataError(f"{url}: unknown URL scheme '{scheme}:' (WebDataset reads local paths and "
                            f"{', '.join(s + ':' for s in sorted(schemes - {''}))})")
    return urls


def check_readers(n_shards: int, world_size: int, num_workers: int, source: str = "") -> int:
    """Fail early if some (rank, worker) reader would get no shard; return the number of readers.
    ``source`` names the mixture source in the message."""
    workers = max(1, num_workers)
    readers = world_size * workers
    if n_shards < readers:
        raise DataError(f"{source}{': ' if source else ''}{n_shards} shards for {readers} readers ({world_size} ranks x {workers} dataloader "
                        f"workers): every reader needs a shard; use at most {max(1, n_shards // world_size)} "
                        f"dataloader workers or build more shards (--num-shards)")
    return readers


class _CheckedStream:
    """A read-only stream that remembers enough to tell a complete tar from a truncated one.

    Python's tarfile (and so webdataset) stops silently at a truncated or garbled header after the
    first member, dropping the rest of the shard without an error. A complete tar ends in zero
    blocks and its size is a multiple of 512, and nothing but zeros follows the end marker, so
    after the iteration we drain the stream and check exactly that. (Compressed tars are left to
    the decompressor's own checks.)
    """

    def __init__(self, raw):
        self.raw, self.size, self.head, self.tail = raw, 0, b"", b""

    def read(self, n=-1):
        data = self.raw.read(n)
        self.size += len(data)
        if len(self.head) < 8:
            self.head = (self.head + data)[:8]
        self.tail = (self.tail + data)[-1024:]
        return data

    def problem_at_end(self) -> str | None:
        compressed = self.head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00"))
        while data := self.read(1 << 16):
            if data.strip(b"\0") and not compressed:
                return "data after the end of the archive (corrupt header?)"
        if compressed:
            return None
        if self.size % 512 or self.size < 1024 or self.tail.strip(b"\0"):
            return f"truncated tar ({self.size} bytes, no end-of-archive marker)"
        return None

    def close(self):
        self.raw.close()


# what a missing, unreadable, truncated or corrupt shard raises
DAMAGE = (OSError, EOFError, ValueError, tarfile.TarError, zlib.error)


def _shard_samples(url: str, problems: list[str]) -> Iterator[dict]:
    """Yield the samples of one shard with webdataset's tar iterators; record what is wrong with it in problems.

    Reading stops at the first error; samples read before it are still yielded.
    """
    def handler(exn):
        if not isinstance(exn, DAMAGE):
            raise exn  # a bug, not a bad shard
        if isinstance(exn, OSError) and exn.strerror:
            message = exn.strerror
        else:  # webdataset appends " @ <stream>" to the message and the url to args
            message = str(exn.args[0]).split(" @ ")[0] if exn.args else ""
        problems.append(f"{type(exn).__name__}: {message}")
        return False  # stop reading this shard

    try:
        stream = _CheckedStream(gopen(url, "rb"))
    except DAMAGE as exn:
        handler(exn)
        return
    try:
        files = tariterators.tar_file_expander([{"url": url, "stream": stream}], handler=handler)
        for sample in tariterators.group_by_keys(files, handler=handler):
            if "bin" in sample:
                yield sample
            else:
                problems.append(f"sample {sample['__key__']} has no .bin member")
        if not problems and (problem := stream.problem_at_end()):
            problems.append(problem)
    finally:
        try:
            stream.close()
        except DAMAGE as exn:  # e.g. a "pipe:" command that exited with an error
            handler(exn)


def iter_shard_documents(urls: list[str]) -> Iterator[Document]:
    """Read documents (bytes and metadata) back from shards, in order; any damage is a DataError."""
    for url in urls:
        problems = []
        for sample in _shard_samples(url, problems):
            try:
                meta = json.loads(sample["json"]) if "json" in sample else {}
            except ValueError as exn:
                raise DataError(f"{url}: sample {sample['__key__']}: invalid json member: {exn}") from None
            yield Document(sample["bin"], meta.get("lang"), meta.get("domain"),
                           meta.get("source") or f"{url}:{sample['__key__']}")
        if problems:
            raise DataError(f"{url}: bad shard: {problems[0]}")


def _windows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """Rows stream[i*seq_len : i*seq_len + seq_len + 1] for every full row: consecutive rows share one token."""
    rows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len]
    return torch.from_numpy(rows.astype(np.int64))


def pack_documents(docs: Iterable[bytes], seq_len: int, encoding=BYTES) -> torch.Tensor:
    """Pack documents with the stream's rule into [N, seq_len + 1]; the last row is padded (encoding.pad).

    For evaluation: every token after the first is a target exactly once, padding targets carry no data.
    """
    chunks = [encoding.doc_ids(d) for d in docs]
    stream = np.concatenate(chunks) if chunks else np.empty(0, dtype=encoding.dtype)
    if len(stream) <= 1:
        return torch.empty(0, seq_len + 1, dtype=torch.long)
    n_rows = -(-(len(stream) - 1) // seq_len)
    padded = np.full(n_rows * seq_len + 1, encoding.pad, dtype=encoding.dtype)
    padded[:len(stream)] = stream
    return _windows(padded, seq_len)


def _pack_batches(docs: Iterable[tuple[bytes, dict]], seq_len: int, batch_size: int, skip_tokens: int = 0,
                  encoding=BYTES) -> Iterator[tuple[torch.Tensor, dict]]:
    """Cut the continuous token stream of docs into [batch_size, seq_len + 1] batches, dropping its first skip_tokens.

    docs yields (document, the reader state just before it); each batch comes with the cursor where the
    next one starts: the state before the document it starts in, plus "offset", its first token's
    index in that document's ids. A batch consumes batch_size * seq_len tokens; its last token is also
    the first of the next batch, so that one always starts inside the last document read.
    """
    step = batch_size * seq_len
    chunks, n = [], 0
    for doc, state in docs:
        tokens = encoding.doc_ids(doc)
        length = len(tokens)
        if skip_tokens:
            cut = min(skip_tokens, len(tokens))
            tokens, skip_tokens = tokens[cut:], skip_tokens - cut
        chunks.append(tokens)
        n += len(tokens)
        while n > step:
            stream = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
            chunks, n = [stream[step:]], n - step
            yield _windows(stream[:step + 1], seq_len), {**state, "offset": length - n}


def epoch_order(n_shards: int, seed: int, epoch: int, source: int, n_sources: int) -> np.ndarray:
    """The shard order of a source in an epoch, the same on every rank; reader r of R reads order[r::R].
    (A single source shuffles with (seed, epoch), as before mixtures existed.)"""
    key = [seed, epoch] if n_sources == 1 else [seed, source, epoch]
    return np.random.default_rng(key).permutation(n_shards)


def unread_pieces(n_shards: list[int], cursors: dict[int, dict], n_readers: int, seed: int,
                  origin: dict | None = None) -> tuple[list[int], list[list[list[int]]]]:
    """What a job's readers had not read of each source's current epoch, from every reader's cursor:
    (the epoch per source, and per source the pieces [shard index, first document] in reader order).

    A source's current epoch is the furthest any reader reached. A reader in it left the rest of its
    shard list from its cursor's document on (that document again from its start: the reader was in
    the middle of it); a reader still in an earlier epoch left its whole share of the current one
    (the rest of its earlier epoch is not read). ``origin``: the readers' stream origin, when it was
    itself finishing an interrupted epoch ({"epochs", "unread"}: their lists in that epoch)."""
    if sorted(cursors) != list(range(n_readers)):
        raise ValueError(f"need the cursors of all {n_readers} readers, have {sorted(cursors)}")
    epochs, pieces = [], []
    for s, n in enumerate(n_shards):
        top = max(c["sources"][s][0] for c in cursors.values())
        if origin and origin.get("unread") and origin["epochs"][s] == top:
            lists = [origin["unread"][s][r::n_readers] for r in range(n_readers)]
        else:
            order = [[int(i), 0] for i in epoch_order(n, seed, top, s, len(n_shards))]
            lists = [order[r::n_readers] for r in range(n_readers)]
        left = []
        for r in range(n_readers):
            epoch, shard, doc, _ = cursors[r]["sources"][s]
            start = (shard, doc) if epoch == top else (0, 0)
            left += [[i, max(first, start[1]) if k == start[0] else first]
                     for k, (i, first) in enumerate(lists[r]) if k >= start[0]]
        epochs.append(top)
        pieces.append(left)
    return epochs, pieces


def is_cursor(c, n_sources: int | None = None) -> bool:
    """Whether ``c`` has a reader cursor's shape (see PackedByteStream), for ``n_sources`` sources if given."""
    return (isinstance(c, dict) and isinstance(c.get("sources"), list) and isinstance(c.get("read"), list)
            and len(c["read"]) == len(c["sources"]) > 0 and n_sources in (None, len(c["sources"]))
            and isinstance(c.get("bad_shards"), int) and isinstance(c.get("offset"), int)
            and all(isinstance(p, list) and len(p) == 4 and all(isinstance(v, int) for v in p) for p in c["sources"]))


class PackedByteStream(IterableDataset):
    """An endless stream of {"tokens": LongTensor[batch_size, seq_len + 1], "epoch", "epochs", "bad_shards",
    "reader", "cursor"} batches: ``epochs`` lists each source's epoch of the reader that made the batch (one
    source unless ``weights``), ``epoch`` is the largest, ``bad_shards`` that reader's count so far,
    ``cursor`` (JSON-able) where that reader's next batch starts.

    ``urls`` are the shard URLs, or with ``weights`` one list of URLs per source of the mixture.
    Use it through make_loader so a rank's batches come round-robin from its workers: that order
    is what start_batch (batches this rank has already consumed) refers to. Resuming is exact as
    long as urls, weights, seed, seq_len, batch_size, world_size and the number of workers are
    unchanged. start_epoch (one per source, or one for all) begins the stream at a later epoch (a
    resume with a different layout starts the next epoch: see megatok/train/data_stream.py).
    ``cursors`` ({reader: the cursor of the last batch consumed from it}) start those readers there
    instead of regenerating start_batch's worth of batches; readers without one regenerate.
    ``unread`` (per source, [shard index, first document] pieces: see unread_pieces) makes the start
    epoch of every source the rest of an epoch that another layout interrupted: these readers share
    those pieces, every n_readers-th each, then go on with the next epoch as usual.
    """

    def __init__(self, urls: list[str] | list[list[str]], *, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, start_batch: int = 0, start_epoch: int | list[int] = 0,
                 on_bad_shard: str = "warn", num_workers_hint: int | None = None, encoding=BYTES,
                 weights: list[float] | None = None, cursors: dict[int, dict] | None = None,
                 unread: list[list[list[int]]] | None = None):
        super().__init__()
        if weights is not None and not all(isinstance(u, (list, tuple)) for u in urls):
            raise ValueError("with weights, urls must be one list of shard URLs per source")
        sources = [list(urls)] if weights is None else [list(u) for u in urls]
        if not urls or not all(sources):
            raise DataError("no shards given")
        if weights is not None and (len(weights) != len(sources) or not all(w > 0 for w in weights)):
            raise ValueError(f"need one positive weight per source, got {weights} for {len(sources)} sources")
        if seq_len < 1 or batch_size < 1 or start_batch < 0 or seed < 0:
            raise ValueError("seq_len and batch_size must be positive, start_batch and seed non-negative")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if on_bad_shard not in ("warn", "error"):
            raise ValueError(f"on_bad_shard must be 'warn' or 'error', got {on_bad_shard!r}")
        start_epochs = [start_epoch] * len(sources) if isinstance(start_epoch, int) else list(start_epoch)
        if len(start_epochs) != len(sources):
            raise ValueError(f"{len(start_epochs)} start epochs for {len(sources)} sources")
        if num_workers_hint is not None:
            for i, u in enumerate(sources):
                check_readers(len(u), world_size, num_workers_hint, f"source {i}" if len(sources) > 1 else "")
        self.sources, self.weights = sources, weights or [1.0]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.start_batch, self.start_epochs, self.on_bad_shard = start_batch, start_epochs, on_bad_shard
        self.encoding = encoding
        if unread is not None and (len(unread) != len(sources) or not all(
                0 <= i < len(u) and first >= 0 for pieces, u in zip(unread, sources) for i, first in pieces)):
            raise ValueError(f"unread pieces do not fit the {len(sources)} source(s) and their shards")
        self.unread = unread
        self.cursors = {int(r): c for r, c in (cursors or {}).items()}
        for r, c in self.cursors.items():
            if not is_cursor(c, len(sources)):
                raise ValueError(f"cursor of reader {r} does not fit {len(sources)} source(s): {c}")

    def epoch_shards(self, epoch: int, reader: int, n_readers: int, source: int = 0) -> list[str]:
        """The shards a reader reads of a source in an epoch (see epoch_order)."""
        return [url for url, _ in self._epoch_pieces(epoch, reader, n_readers, source)]

    def _epoch_pieces(self, epoch: int, reader: int, n_readers: int, source: int) -> list[tuple[str, int]]:
        """(shard URL, first document) for each shard a reader reads of a source in an epoch: every
        n_readers-th of the epoch's order, or in a stream that finishes an interrupted epoch (``unread``)
        every n_readers-th of the pieces its earlier layout had not read."""
        urls = self.sources[source]
        if self.unread is not None and epoch == self.start_epochs[source]:
            return [(urls[i], first) for i, first in self.unread[source][reader::n_readers]]
        order = epoch_order(len(urls), self.seed, epoch, source, len(self.sources))
        return [(urls[i], 0) for i in order[reader::n_readers]]

    def _source_documents(self, source: int, reader: int, n_readers: int, state: dict) -> Iterator[tuple[bytes, list]]:
        """This reader's documents of one source, epoch after epoch, from state["sources"][source]: [epoch,
        shard (its index in the epoch's list), document (its index in the shard), documents read in the
        epoch], the next document to read. Yields (document, its position), moving the position past it
        first; counts bad shards in state["bad_shards"]."""
        pos = state["sources"][source]
        while True:
            epoch = pos[0]
            shards = self._epoch_pieces(epoch, reader, n_readers, source)
            while pos[1] < len(shards):
                (url, first), problems = shards[pos[1]], []
                pos[2] = max(pos[2], first)
                for i, sample in enumerate(_shard_samples(url, problems)):
                    if i >= pos[2]:  # documents before pos[2] were read before a resume
                        at = list(pos)
                        pos[2], pos[3] = i + 1, pos[3] + 1
                        yield sample["bin"], at
                if problems:
                    if self.on_bad_shard == "error":
                        raise DataError(f"{url}: bad shard: {problems[0]}")
                    state["bad_shards"] += 1
                    warnings.warn(f"{url}: bad shard ({problems[0]}); used the {pos[2]} documents read "
                                  f"before the damage and moved on to the next shard", BadShardWarning)
                pos[1], pos[2] = pos[1] + 1, 0
            if pos[3] == 0 and (self.unread is None or epoch != self.start_epochs[source]):
                raise DataError(f"reader {reader} of {n_readers} read no documents in epoch {epoch} from its "
                                f"shards: {', '.join(url for url, _ in shards)}")
            pos[:] = [epoch + 1, 0, 0, 0]

    def _documents(self, reader: int, n_readers: int, state: dict) -> Iterator[tuple[bytes, dict]]:
        """This reader's documents, each with the reader state just before it (what a cursor records): one
        source's as they come, or a mixture's by deficit (the next document comes from the source with
        the fewest bytes read relative to its weight; ties to the first)."""
        streams = [self._source_documents(i, reader, n_readers, state) for i in range(len(self.sources))]
        read = state["read"]
        while True:
            i = 0 if len(streams) == 1 else min(range(len(streams)), key=lambda j: (read[j] / self.weights[j], j))
            doc, at = next(streams[i])
            before = {"sources": [at if j == i else list(p) for j, p in enumerate(state["sources"])],
                      "read": list(read), "bad_shards": state["bad_shards"]}
            read[i] += len(doc) + 1  # + the separator, so empty documents still count
            yield doc, before

    def start_state(self, reader: int) -> tuple[dict, int | None]:
        """(reader state, token offset) where this reader resumes: its cursor's, or the stream's start
        (offset None: skip the batches it had produced, by regenerating them)."""
        cursor = self.cursors.get(reader)
        if cursor is None:
            return {"sources": [[e, 0, 0, 0] for e in self.start_epochs], "read": [0] * len(self.sources),
                    "bad_shards": 0}, None
        return {"sources": [list(p) for p in cursor["sources"]], "read": list(cursor["read"]),
                "bad_shards": cursor["bad_shards"]}, cursor["offset"]

    def __iter__(self):
        info = get_worker_info()
        num_workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        for i, u in enumerate(self.sources):
            n_readers = check_readers(len(u), self.world_size, num_workers, f"source {i}" if len(self.sources) > 1 else "")
        # The loader's first batch after a restart is batch start_batch of the rank, which came from worker
        # start_batch % W in the original run: rotate the workers so each continues the right stream.
        logical = (worker + self.start_batch) % num_workers
        reader = self.rank * num_workers + logical
        state, offset = self.start_state(reader)
        if offset is None:
            done = len(range(logical, self.start_batch, num_workers))  # batches this reader had produced
            offset = done * self.batch_size * self.seq_len
        docs = self._documents(reader, n_readers, state)
        for tokens, cursor in _pack_batches(docs, self.seq_len, self.batch_size, offset, self.encoding):
            epochs = [p[0] for p in state["sources"]]
            yield {"tokens": tokens, "epoch": max(epochs), "epochs": epochs, "bad_shards": state["bad_shards"],
                   "reader": reader, "cursor": cursor}


def make_loader(dataset: PackedByteStream, num_workers: int, pin_memory: bool = False) -> DataLoader:
    """A DataLoader that yields the dataset's batches as they are, round-robin over workers in order;
    ``pin_memory`` (for a GPU): in page-locked memory, whose copy to the GPU (``non_blocking``) does not
    wait for the GPU's queue.

    Workers ignore SIGTERM/SIGINT: a pre-empted rank finishes its step and checkpoints with its
    workers still alive (launchers signal the whole process tree); they exit with their parent."""
    return DataLoader(dataset, batch_size=None, num_workers=num_workers, in_order=True, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, worker_init_fn=_ignore_stop_signals if num_workers else None)


def _ignore_stop_signals(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
