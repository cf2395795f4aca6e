import json
import os
import random
import signal
import tarfile
import warnings
from collections import Counter
import contextlib
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds

from megatok.data import stream
from megatok.data.documents import DataError
from megatok.data.shards import build_shards
from megatok.data.stream import (BadShardWarning, PackedByteStream, check_readers, iter_shard_documents,
                                 make_loader, pack_documents, resolve_shards, resolve_sources)
from megatok.vocab import PAD, SEP

SEQ_LEN, BATCH = 32, 4


def make_shards(tmp_path, n_docs=40, num_shards=8, seed=0, tag=""):
    """n_docs unique documents of 10-100 bytes (every byte value allowed) in num_shards equal shards;
    each starts with "<" + tag + its number."""
    rng = random.Random(seed)
    tmp_path.mkdir(parents=True, exist_ok=True)
    docs = [f"<{tag}{i:04d}>".encode() + bytes(rng.randrange(256) for _ in range(rng.randint(4, 94)))
            for i in range(n_docs)]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for d in docs:  # latin-1 maps every byte to one code point; the shards get its UTF-8 encoding
            f.write(json.dumps({"text": d.decode("latin-1")}) + "\n")
    out = str(tmp_path / "shards")
    build_shards([str(tmp_path / "docs.jsonl")], out, val_fraction=0, num_shards=num_shards, progress=False)
    urls = resolve_shards(out)
    return urls, Counter(d.decode("latin-1").encode() for d in docs)


def take(dataset, n, num_workers=0):
    """The first n batches of a dataset, read through make_loader (real worker processes when num_workers > 0)."""
    loader = make_loader(dataset, num_workers)
    it = iter(loader)
    batches = [next(it) for _ in range(n)]
    del it
    return batches


def reader_stream(batches) -> np.ndarray:
    """Undo the packing of one reader's consecutive batches: rows overlap by exactly one token."""
    rows = [row for b in batches for row in b["tokens"].numpy()]
    for a, b in zip(rows, rows[1:]):
        assert a[-1] == b[0]
    return np.concatenate([rows[0]] + [r[1:] for r in rows[1:]])


def split_docs(stream: np.ndarray) -> list[bytes]:
    """The complete documents in a token stream (each starts after a SEP and ends at the next one)."""
    seps = np.flatnonzero(stream == SEP)
    assert seps[0] == 0
    return [stream[a + 1:b].astype(np.uint8).tobytes() for a, b in zip(seps, seps[1:])]


@contextmanager
def time_limit(seconds):
    def fail(*_):
        raise TimeoutError(f"did not finish within {seconds} s (hang?)")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_every_document_once_per_epoch_across_2_ranks_x_2_workers(tmp_path):
    urls, all_docs = make_shards(tmp_path)  # 8 shards x 5 documents: each of 4 readers reads 10 per epoch
    per_epoch = {0: Counter(), 1: Counter()}
    for rank in range(2):
        ds = PackedByteStream(urls, seq_len=SEQ_LEN, batch_size=BATCH, rank=rank, world_size=2, seed=3)
        batches = take(ds, 50, num_workers=2)
        for worker in range(2):
            mine = batches[worker::2]  # round robin over the rank's workers
            assert mine[-1]["epoch"] >= 2 and all(b["bad_shards"] == 0 for b in mine)
            docs = split_docs(reader_stream(mine))
            per_epoch[0].update(docs[:10])
            per_epoch[1].update(docs[10:20])
    assert per_epoch[0] == all_docs and per_epoch[1] == all_docs


def test_packing_rule_and_carry_over_between_epochs(tmp_path):
    urls, _ = make_shards(tmp_path, n_docs=7, num_shards=1)
    docs = [d.text for d in iter_shard_documents(urls)]
    ds = PackedByteStream(urls, seq_len=SEQ_LEN, batch_size=BATCH)
    batches = take(ds, 12)
    one_epoch = np.concatenate([np.concatenate([[SEP], np.frombuffer(d, np.uint8)]) for d in docs])
    stream = reader_stream(batches)
    assert len(stream) == 12 * BATCH * SEQ_LEN + 1 > 3 * len(one_epoch)
    repeated = np.tile(one_epoch, len(stream) // len(one_epoch) + 1)[:len(stream)]
    assert np.array_equal(stream, repeated)  # SEP before each document, no byte lost, leftovers carried over
    assert [b["epoch"] for b in batches][-1] >= 3
    packed = pack_documents(docs, SEQ_LEN)
    n = len(one_epoch) // SEQ_LEN // BATCH * BATCH
    assert torch.equal(torch.cat([b["tokens"] for b in batches])[:n], packed[:n])
    assert batches[0]["tokens"].dtype == torch.long and batches[0]["tokens"].shape == (BATCH, SEQ_LEN + 1)


def test_pack_documents_pads_the_last_row():
    packed = pack_documents([b"ab", b"cde"], 3)
    assert packed.tolist() == [[SEP, 97, 98, SEP], [SEP, 99, 100, 101]]
    assert pack_documents([b"abcd"], 3).tolist() == [[SEP, 97, 98, 99], [99, 100, PAD, PAD]]
    assert pack_documents([], 3).shape == (0, 4)


def test_deterministic_and_resume_continues_exactly(tmp_path):
    urls, _ = make_shards(tmp_path, n_docs=24, num_shards=4)
    kw = dict(seq_len=SEQ_LEN, batch_size=BATCH, rank=1, world_size=2, seed=7)
    full = take(PackedByteStream(urls, **kw), 20, num_workers=2)
    again = take(PackedByteStream(urls, **kw), 20, num_workers=2)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(full, again))
    for start in (7, 10):  # odd: the restarted loader's first batch must come from the original worker 1
        resumed = take(PackedByteStream(urls, start_batch=start, **kw), 20 - start, num_workers=2)
        for a, b in zip(full[start:], resumed):
            assert torch.equal(a["tokens"], b["tokens"]) and a["epoch"] == b["epoch"]
    other_seed = take(PackedByteStream(urls, **{**kw, "seed": 8}), 20, num_workers=2)
    assert not all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(full, other_seed))


class CountingBytes:
    """The byte encoding, counting the documents it turns into ids."""
    def __init__(self):
        self.calls, self.dtype, self.pad = 0, stream.BYTES.dtype, stream.BYTES.pad

    def doc_ids(self, doc):
        self.calls += 1
        return stream.BYTES.doc_ids(doc)


@pytest.mark.parametrize("case", ["plain", "damaged", "mixture"])
def test_resume_from_cursors_continues_exactly_without_rereading(tmp_path, monkeypatch, case):
    urls, _ = make_shards(tmp_path / "a", n_docs=32, num_shards=8, seed=1, tag="A")
    kw = dict(seq_len=SEQ_LEN, batch_size=BATCH, rank=1, world_size=2, seed=7)
    if case == "damaged":
        damage(urls[3], "truncated")
    if case == "mixture":
        b, _ = make_shards(tmp_path / "b", n_docs=8, num_shards=4, seed=2, tag="B")
        urls, kw = [urls, b], {**kw, "weights": [3.0, 1.0]}
    with warnings.catch_warnings(), time_limit(60):
        warnings.simplefilter("ignore", BadShardWarning)
        full = take(PackedByteStream(urls, **kw), 24, num_workers=2)  # 12 per reader: several epochs
        assert full[-1]["epoch"] >= 2 and (case != "damaged" or full[-1]["bad_shards"] >= 1)
        for start in (7, 12):  # odd: the restarted loader's first batch must come from the original worker 1
            cursors = {b["reader"]: b["cursor"] for b in full[:start]}  # the last batch consumed from each
            cursors = json.loads(json.dumps(cursors))  # as a checkpoint stores them
            resumed = take(PackedByteStream(urls, start_batch=start, cursors=cursors, **kw), 24 - start, num_workers=2)
            for a, b in zip(full[start:], resumed, strict=True):
                assert torch.equal(a["tokens"], b["tokens"])
                assert {k: a[k] for k in a if k != "tokens"} == {k: b[k] for k in b if k != "tokens"}

        # One reader in this process: resuming opens the cursor's shard first and tokenizes only from its document
        one = {**kw, "world_size": 1, "rank": 0}
        batches = take(PackedByteStream(urls, **one), 12)
        cursor = batches[-2]["cursor"]
        opened = []
        real = stream._shard_samples
        monkeypatch.setattr(stream, "_shard_samples", lambda url, problems: (opened.append(url), real(url, problems))[1])
        counted = {how: CountingBytes() for how in ("cursor", "regenerate")}
        got = {how: take(PackedByteStream(urls, start_batch=11, encoding=counted[how],
                                          cursors={0: cursor} if how == "cursor" else None, **one), 1)[0]
               for how in counted}
    assert torch.equal(got["cursor"]["tokens"], batches[-1]["tokens"])
    assert torch.equal(got["regenerate"]["tokens"], batches[-1]["tokens"])
    source = max(range(len(cursor["sources"])), key=lambda i: cursor["sources"][i][3])
    epoch, shard = cursor["sources"][source][:2]
    ds = PackedByteStream(urls, **one)
    first = ds.epoch_shards(epoch, 0, 1, source)[shard]
    assert first in opened and opened.index(first) < len(opened) // 2  # opened before the regeneration began
    assert counted["cursor"].calls <= 1 + BATCH * SEQ_LEN // 10  # documents are >= 10 bytes
    assert counted["regenerate"].calls > 3 * counted["cursor"].calls
    with pytest.raises(ValueError, match="cursor of reader 0 does not fit"):
        PackedByteStream(urls, cursors={0: {"sources": []}}, **one)


def read_before(ds, reader, n_readers, source, stop, state=None):
    """(epoch, document) of one reader's source, in order, before the position ``stop`` (which may
    point past the end of a shard: the next document to read after the shard's last)."""
    state = state or ds.start_state(reader)[0]
    out = []
    for doc, at in ds._source_documents(source, reader, n_readers, state):
        if at[:3] >= stop[:3]:
            return out
        out.append((at[0], doc))


def leftover_docs(ds, reader, n_readers, source):
    """The documents a reader of a stream with ``unread`` pieces reads in the epoch it finishes."""
    out = []
    for doc, at in ds._source_documents(source, reader, n_readers, ds.start_state(reader)[0]):
        if at[0] != ds.start_epochs[source]:
            return out
        out.append(doc)


@pytest.mark.parametrize("case", ["plain", "mixture"])
def test_a_new_layout_reads_what_the_old_one_left_of_the_epoch_once(tmp_path, case):
    """Three readers stop at different places; two then share what they had not read of the current
    epoch, stop again, and four share the rest: every document of that epoch is read exactly once
    (the ones a reader was in the middle of, from their start), then the stream goes on."""
    a, docs_a = make_shards(tmp_path / "a", n_docs=60, num_shards=12, seed=3, tag="A")
    sources, weights = [a], None
    if case == "mixture":
        b, _ = make_shards(tmp_path / "b", n_docs=30, num_shards=6, seed=4, tag="B")
        sources, weights = [a, b], [2.0, 1.0]
    urls = sources if weights else a
    kw = dict(seq_len=SEQ_LEN, batch_size=BATCH, seed=5, weights=weights)
    counts = [len(u) for u in sources]
    layouts, origin, epochs = [], None, None
    stack = contextlib.ExitStack()
    stack.enter_context(time_limit(60))
    for n_readers, taken in ((3, (9, 14 if case == "plain" else 30, 3)), (2, (4, 2)), (4, None)):
        streams = [PackedByteStream(urls, rank=r, world_size=n_readers, start_epoch=epochs or 0,
                                    unread=origin and origin["unread"], **kw) for r in range(n_readers)]
        if taken is None:
            break
        cursors = {r: take(ds, n)[-1]["cursor"] for r, (ds, n) in enumerate(zip(streams, taken))}
        cursors = json.loads(json.dumps(cursors), object_hook=lambda d: {int(k) if k.isdigit() else k: v
                                                                          for k, v in d.items()})
        layouts.append((streams, n_readers, cursors))
        epochs, unread = stream.unread_pieces(counts, cursors, n_readers, 5, origin)
        origin = {"epochs": epochs, "unread": unread}
    for s, (tag, n_docs) in enumerate([(b"<A", 60), (b"<B", 30)][:len(sources)]):
        read = [doc for streams_, n, cursors in layouts for r, ds in enumerate(streams_)
                for e, doc in read_before(ds, r, n, s, cursors[r]["sources"][s]) if e == epochs[s]]
        read += [doc for r, ds in enumerate(streams) for doc in leftover_docs(ds, r, 4, s)]
        assert len(read) == n_docs and len(set(read)) == n_docs and all(d.startswith(tag) for d in read), s
    assert set(d for d in read if d.startswith(b"<A")) == set(docs_a) or case == "mixture"
    # a reader of the first layout was an epoch behind another: its share of the later epoch was all unread
    first = layouts[0][2]
    assert any(c["sources"][s][0] < max(d["sources"][s][0] for d in first.values())
               for c in first.values() for s in range(len(sources)))
    # the finishing stream then goes on with the next epoch; its batches carry cursors that resume it exactly
    full = take(streams[1], 12)
    again = take(PackedByteStream(urls, rank=1, world_size=4, start_epoch=epochs, unread=unread,
                                  start_batch=5, cursors={1: full[4]["cursor"]}, **kw), 7)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(full[5:], again))
    assert max(full[-1]["epochs"]) > max(epochs)
    stack.close()
    with pytest.raises(ValueError, match="unread pieces do not fit"):
        PackedByteStream(urls, unread=[[[99, 0]]] * len(sources), **kw)


def damage(path, kind):
    data = open(path, "rb").read()
    if kind == "empty":
        data = b""
    elif kind == "truncated":
        data = data[:len(data) // 2 + 100]
    elif kind == "cut_at_member":  # tarfile itself reports nothing here: the end-of-archive check must
        data = data[:tarfile.open(path).getmembers()[4].offset]
    elif kind == "bad_header":  # a garbled header after the first member: tarfile stops silently
        offset = tarfile.open(path).getmembers()[4].offset
        data = data[:offset] + b"\xff" * 512 + data[offset + 512:]
    open(path, "wb").write(data)


@pytest.mark.parametrize("kind", ["empty", "truncated", "cut_at_member", "bad_header"])
def test_bad_shard_warns_and_the_stream_continues(tmp_path, kind):
    urls, all_docs = make_shards(tmp_path, num_shards=4)
    damage(urls[2], kind)
    ds = PackedByteStream(urls, seq_len=SEQ_LEN, batch_size=BATCH, seed=1)
    with pytest.warns(BadShardWarning) as record:
        with time_limit(30):
            batches = []
            for b in ds:
                batches.append(b)
                if b["epoch"] == 2:
                    break
    assert any(urls[2] in str(w.message) for w in record)
    assert batches[-1]["bad_shards"] >= 2  # counted again every epoch
    good = Counter(d.text for url in urls if url != urls[2] for d in iter_shard_documents([url]))
    seen = Counter(split_docs(reader_stream(batches)))
    assert all(seen[d] >= 1 for d in good)  # everything in the good shards still arrives
    assert set(seen) <= set(all_docs)  # and nothing partial from the damaged one

    ds = PackedByteStream(urls, seq_len=SEQ_LEN, batch_size=BATCH, seed=1, on_bad_shard="error")
    with pytest.raises(DataError, match=f"{urls[2]}: bad shard"), time_limit(30):
        for _ in ds:
            pass
    with pytest.raises(DataError, match=f"{urls[2]}: bad shard"):
        list(iter_shard_documents(urls))


def test_reader_with_only_bad_or_empty_shards_raises_instead_of_hanging(tmp_path):
    urls, _ = make_shards(tmp_path, num_shards=2)
    damage(urls[0], "empty")
    garbage = str(tmp_path / "garbage.tar")
    open(garbage, "wb").write(bytes(range(256)) * 20)
    empty_tar = str(tmp_path / "empty.tar")
    wds.TarWriter(empty_tar).close()  # a valid tar with no samples
    for bad in ([urls[0]], [empty_tar], [urls[0], garbage, empty_tar]):
        ds = PackedByteStream(bad, seq_len=SEQ_LEN, batch_size=BATCH)
        with warnings.catch_warnings(), time_limit(30):
            warnings.simplefilter("ignore", BadShardWarning)
            with pytest.raises(DataError, match="read no documents in epoch 0") as info:
                next(iter(ds))
        assert all(u in str(info.value) for u in bad)


def test_mixture_follows_the_weights_by_bytes_and_resumes_exactly(tmp_path):
    a, docs_a = make_shards(tmp_path / "a", n_docs=40, num_shards=4, seed=1, tag="A")
    b, docs_b = make_shards(tmp_path / "b", n_docs=8, num_shards=4, seed=2, tag="B")
    kw = dict(seq_len=SEQ_LEN, batch_size=BATCH, rank=1, world_size=2, seed=5, weights=[3.0, 1.0])
    batches = take(PackedByteStream([a, b], **kw), 30)  # reader 1 of 2: 2 shards of each source per epoch
    docs = split_docs(reader_stream(batches))
    assert set(d for d in docs if d.startswith(b"<A")) <= set(docs_a)
    assert set(d for d in docs if d.startswith(b"<B")) <= set(docs_b)
    read = {tag: sum(len(d) + 1 for d in docs if d.startswith(b"<" + tag)) for tag in (b"A", b"B")}
    assert sum(read.values()) > 3000
    # Deficit rule: A's bytes / 3 and B's stay within a document (<= 101 bytes) of each other, plus the
    # partial documents cut off at both ends of the window.
    assert abs(read[b"A"] / 3 - read[b"B"]) < 3 * 101, read
    # B (4 documents per reader per epoch) cycles faster than A (20): epochs are counted per source
    epochs = batches[-1]["epochs"]
    assert epochs[1] > epochs[0] >= 0 and batches[-1]["epoch"] == epochs[1]
    # Resume through 2 workers from an odd batch: the same batches as the uninterrupted run
    with time_limit(60):
        full = take(PackedByteStream([a, b], **kw), 12, num_workers=2)
        resumed = take(PackedByteStream([a, b], start_batch=5, **kw), 7, num_workers=2)
    for x, y in zip(full[5:], resumed):
        assert torch.equal(x["tokens"], y["tokens"]) and x["epochs"] == y["epochs"]
    # A mixture of one source is the plain stream, whose shuffle is keyed (seed, epoch) as before mixtures
    one = PackedByteStream([a], **{**kw, "weights": [2.0]})
    plain = PackedByteStream(a, **{**kw, "weights": None})
    for epoch in (0, 1):
        want = [a[i] for i in np.random.default_rng([5, epoch]).permutation(len(a))[1::2]]
        assert one.epoch_shards(epoch, 1, 2) == plain.epoch_shards(epoch, 1, 2) == want
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(take(one, 5), take(plain, 5)))
    with pytest.raises(ValueError, match="one list of shard URLs per source"):
        PackedByteStream(a, **kw)
    with pytest.raises(ValueError, match="one positive weight per source"):
        PackedByteStream([a, b], **{**kw, "weights": [1.0]})
    with pytest.raises(ValueError, match="one positive weight per source"):
        PackedByteStream([a, b], **{**kw, "weights": [1.0, 0.0]})
    with pytest.raises(DataError, match="source 1: 2 shards for 4 readers"):
        PackedByteStream([a, b[:2]], num_workers_hint=2, **kw)


def test_stream_position_counts_every_reader_not_the_last_batch(tmp_path):
    """The trainer records the furthest epoch over all of a rank's readers (and every reader's bad
    shards): batches come round-robin from the workers, so the step's last batch speaks for one."""
    from megatok.train.data_stream import StreamPosition

    urls, _ = make_shards(tmp_path, n_docs=16, num_shards=2, seed=4)  # 2 workers, one shard each
    batches = take(PackedByteStream(urls, seq_len=SEQ_LEN, batch_size=BATCH), 40, num_workers=2)
    position, behind = StreamPosition([0]), 0
    for b in batches:
        position.update(b)
        behind += b["epoch"] < position.epochs[0]  # the last batch alone would have recorded less
    assert position.epochs == [max(b["epoch"] for b in batches)]
    assert behind > 0 and {b["reader"] for b in batches} == {0, 1}
    assert position.cursors == {r: [b for b in batches if b["reader"] == r][-1]["cursor"] for r in (0, 1)}
    position.update({"epochs": [0], "reader": 0, "bad_shards": 2, "cursor": {}})
    position.update({"epochs": [0], "reader": 1, "bad_shards": 1, "cursor": {}})
    position.update({"epochs": [0], "reader": 0, "bad_shards": 3, "cursor": {}})  # running counts per reader
    assert position.bad_shards == 4 and position.epochs == [max(b["epoch"] for b in batches)]
    # a resumed rank keeps the cursors it started from until its readers produce new ones, and reports
    # their epochs and bad shards before they do (the first row after a resume, a save soon after it)
    resumed = {r: [b for b in batches if b["reader"] == r][-1]["cursor"] for r in (0, 1)}
    fresh = StreamPosition([0], resumed)
    assert fresh.cursors == resumed and fresh.epochs == [max(b["epoch"] for b in batches)]
    resumed = {4: {"sources": [[1, 0, 3, 0]], "bad_shards": 2}, 5: {"sources": [[2, 1, 0, 0]], "bad_shards": 1}}
    fresh = StreamPosition([0], resumed)
    assert fresh.epochs == [2] and fresh.bad_shards == 3
    fresh.update({"epochs": [1], "reader": 4, "bad_shards": 2, "cursor": {}})
    assert fresh.epochs == [2] and fresh.bad_shards == 3  # reader 5 has not produced a batch yet


def test_too_few_shards_for_the_readers(tmp_path, monkeypatch):
    urls, _ = make_shards(tmp_path, n_docs=12, num_shards=3)
    assert check_readers(3, 1, 3) == 3
    with pytest.raises(DataError, match="3 shards for 4 readers"):
        check_readers(3, 2, 2)
    with pytest.raises(DataError, match="3 shards for 4 readers"):
        PackedByteStream(urls, seq_len=8, batch_size=2, world_size=2, num_workers_hint=2)
    ds = PackedByteStream(urls, seq_len=8, batch_size=2, world_size=2)
    next(iter(ds))  # no workers: 2 readers for 3 shards is fine
    # in a worker of 2 (not through a real DataLoader: after a worker raises, torch spends 5 s per worker
    # shutting the loader down)
    monkeypatch.setattr(stream, "get_worker_info", lambda: SimpleNamespace(num_workers=2, id=1))
    with pytest.raises(DataError, match="3 shards for 4 readers"):
        next(iter(ds))


def test_resolve_shards(tmp_path):
    urls, _ = make_shards(tmp_path, num_shards=3)
    shard_dir = os.path.dirname(urls[0])
    assert urls == [os.path.join(shard_dir, f"train-{i:05d}.tar") for i in range(3)]
    assert resolve_shards(os.path.join(shard_dir, "train-{00000..00002}.tar")) == urls
    assert resolve_shards(urls[:2]) == urls[:2]
    assert resolve_shards("pipe:cat a.tar::pipe:cat b.tar") == ["pipe:cat a.tar", "pipe:cat b.tar"]
    with pytest.raises(DataError, match="lists no val shards"):
        resolve_shards(shard_dir, "val")
    with pytest.raises(DataError, match="manifest.json: no manifest"):
        resolve_shards(str(tmp_path))
    with pytest.raises(DataError, match="no shards"):
        resolve_shards([])
    # a mixture: its sources' URLs, in order (resolve_sources keeps them apart, with the weights)
    assert resolve_shards({shard_dir: 2, urls[0]: 1}) == urls + urls[:1]
    assert resolve_sources({shard_dir: 2, urls[0]: 1}) == ([urls, urls[:1]], [2.0, 1.0])
    assert resolve_sources(shard_dir) == ([urls], None)
    os.remove(urls[1])
    with pytest.raises(DataError, match="train-00001.tar: shard file not found"):
        resolve_shards(shard_dir)


def test_validation_shards_of_urls_must_be_named(tmp_path):
    from megatok.data.stream import validation_sources

    urls, _ = make_shards(tmp_path, num_shards=3)
    shard_dir = os.path.dirname(urls[0])
    pattern = "pipe:cat " + os.path.join(shard_dir, "train-{00000..00002}.tar")
    with pytest.raises(DataError, match="manifest lists no val shards"):  # a directory: its own val split
        validation_sources(shard_dir, None)
    for shards in (pattern, urls, {shard_dir: 1, pattern: 1}):
        with pytest.raises(DataError, match="URLs and shard lists have no val split; set data.val_shards"):
            validation_sources(shards, None)
    assert validation_sources(pattern, urls[:1]) == ([urls[:1]], None)  # named: used as given


def test_url_schemes_are_those_webdataset_opens(monkeypatch):
    for url in ("pipe:cat a.tar", "file:///data/a.tar", "https://host/a.tar", "HTTPS://host/a.tar", "gs://b/a.tar",
                "sftp://host/a.tar"):
        assert resolve_shards(url) == [url]
    with pytest.raises(DataError, match=r"htps://host/a-1.tar: unknown URL scheme 'htps:' \(WebDataset reads"):
        resolve_shards("htps://host/a-{1..2}.tar")
    with pytest.raises(DataError, match="s3://bucket/a.tar: unknown URL scheme 's3:'"):
        resolve_shards("s3://bucket/a.tar")
    monkeypatch.setenv("GOPEN_REWRITE", "s3://bucket/=pipe:aws s3 cp s3://bucket/")  # WebDataset's own rewrite
    assert resolve_shards("s3://bucket/a.tar") == ["s3://bucket/a.tar"]
    with pytest.raises(DataError, match="not a shard pattern"):
        resolve_shards('{"a": 1, "b": 2')


def test_unread_pieces_keep_the_documents_already_skipped_in_a_piece():
    """An origin that was itself finishing an epoch can hold a piece that starts mid-shard ([shard 2,
    first document 5]); a reader of the next layout stopped at that piece's start (document 0 of its
    list) must not read documents 0-4 again, and one further in keeps its own position."""
    origin = {"epochs": [1], "unread": [[[2, 5], [0, 0], [1, 3]]]}

    def cursor(k, doc):  # [epoch, index in the reader's list, document, offset]
        return {"sources": [[1, k, doc, 0]], "read": [0], "bad_shards": 0, "offset": 0}

    assert stream.unread_pieces([3], {0: cursor(0, 0)}, 1, 5, origin) == ([1], [[[2, 5], [0, 0], [1, 3]]])
    assert stream.unread_pieces([3], {0: cursor(0, 7)}, 1, 5, origin) == ([1], [[[2, 7], [0, 0], [1, 3]]])
    assert stream.unread_pieces([3], {0: cursor(2, 1)}, 1, 5, origin) == ([1], [[[1, 3]]])
    assert stream.unread_pieces([3], {0: cursor(2, 4)}, 1, 5, origin) == ([1], [[[1, 4]]])


def test_is_cursor_takes_only_a_reader_cursors_shape():
    good = {"sources": [[1, 0, 3, 0], [0, 2, 0, 5]], "read": [10, 4], "bad_shards": 0, "offset": 7}
    assert stream.is_cursor(good) and stream.is_cursor(good, 2) and not stream.is_cursor(good, 1)
    for bad in ({"offset": "7"}, {"offset": None}, {"bad_shards": 1.0}, {"read": [10]}, {"sources": []},
                {"sources": [[1, 0, 3], [0, 2, 0, 5]]}, {"sources": [[1, 0, 3, 0.5], [0, 2, 0, 5]]}):
        assert not stream.is_cursor({**good, **bad}), bad
    assert not stream.is_cursor(None) and not stream.is_cursor([good])
