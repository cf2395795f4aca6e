"""The input formats besides .txt and .jsonl(.gz): .jsonl.zst / .json.gz (Dolma, RedPajama), parquet
(FineWeb, the hub cache), Arrow (datasets.save_to_disk), with configurable field names; a parallel
build gives the shards of a one-process build; bad files are one DataError line naming the file."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megatok.data.documents import DataError, Fields, Unit, iter_documents, list_input_files, units_of
from megatok.data.shards import build_shards, read_manifest
from megatok.data.stream import iter_shard_documents, resolve_shards
from tests.conftest import ROOT, run_tool, stdlib_texts

RECORDS = [
    {"text": "caf\u00e9 au lait", "language": "fr", "meta": {"source": "web", "lang": "fr"}},
    {"text": "second document", "language": None, "meta": {"source": "books", "lang": None}},
    {"text": "", "language": "en", "meta": {"source": "web", "lang": "en"}},  # empty: skipped, counted
    {"text": "\u043f\u0440\u0438\u0432\u0435\u0442", "language": "ru", "meta": {"source": None, "lang": "ru"}},
]
# what every format gives for RECORDS with --lang-field language --domain-field meta.source, lang und
# where a record has none
EXPECTED = [("caf\u00e9 au lait".encode(), "fr", "web"), (b"second document", "und", "books"),
            ("\u043f\u0440\u0438\u0432\u0435\u0442".encode(), "ru", None)]
FIELDS = Fields(lang="language", domain="meta.source")


def jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def write_zst(path, data: bytes, frames: int = 1) -> str:
    """zstd in ``frames`` concatenated frames (as pzstd and `cat a.zst b.zst` write)."""
    cut = [len(data) * k // frames for k in range(frames + 1)]
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(data[a:b]) for a, b in zip(cut, cut[1:])))
    return str(path)


def write_parquet(path, records, row_group_size=None) -> str:
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return str(path)


def read(paths, **kw) -> list[tuple]:
    return [(d.text, d.lang, d.domain) for d in iter_documents(paths, lang="und", fields=FIELDS, **kw)]


def test_every_format_gives_the_same_documents_with_mapped_fields(tmp_path):
    import datasets  # a requirement; the import is slow, so only here
    data = jsonl_bytes(RECORDS)
    files = {
        "jsonl": tmp_path / "a.jsonl", "jsonl.gz": tmp_path / "a.jsonl.gz", "json.gz": tmp_path / "a.json.gz",
    }
    files["jsonl"].write_bytes(data)
    files["jsonl.gz"].write_bytes(gzip.compress(data))
    files["json.gz"].write_bytes(gzip.compress(data))
    files["jsonl.zst"] = write_zst(tmp_path / "a.jsonl.zst", data, frames=3)
    files["json.zst"] = write_zst(tmp_path / "a.json.zst", data)
    files["parquet"] = write_parquet(tmp_path / "a.parquet", RECORDS, row_group_size=2)
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
    files["save_to_disk"] = tmp_path / "saved"
    for name, path in files.items():
        stats = {}
        assert read([str(path)], stats=stats) == EXPECTED, name
        assert stats["empty_documents"] == 1, name
    # sources: the line of a JSON line (from 1), the row of a parquet or Arrow record (from 0)
    assert [d.source for d in iter_documents([str(files["jsonl.zst"])])] == [
        f"{files['jsonl.zst']}:{k}" for k in (1, 2, 4)]
    arrow = list_input_files([str(tmp_path / "saved")])
    assert len(arrow) == 1 and arrow[0].endswith(".arrow")  # state.json, dataset_info.json are not inputs
    assert [d.source for d in iter_documents([str(files["parquet"])])] == [
        f"{files['parquet']}:row{k}" for k in (0, 1, 3)]


def test_default_fields_text_field_and_zst_text(tmp_path):
    """Without field options: "text", "lang", "domain" as before (RedPajama's nested meta.language is
    not read unless named); --text-field reads another column; .txt.zst is one document."""
    rows = [{"content": "alpha", "lang": "de", "domain": "code", "meta": {"language": "en"}},
            {"content": "beta", "lang": None, "domain": None, "meta": {"language": "fr"}}]
    path = write_parquet(tmp_path / "code.parquet", rows)
    docs = list(iter_documents([path], fields=Fields(text="content")))
    assert [(d.text, d.lang, d.domain) for d in docs] == [(b"alpha", "de", "code"), (b"beta", None, None)]
    docs = list(iter_documents([path], fields=Fields(text="content", lang="meta.language")))
    assert [d.lang for d in docs] == ["en", "fr"]
    write_zst(tmp_path / "book.txt.zst", b"raw \xff bytes\n")
    assert [d.text for d in iter_documents([str(tmp_path / "book.txt.zst")])] == [b"raw \xff bytes\n"]


def test_the_hub_cache_layout_and_datasets_cache_files(tmp_path):
    """The hub cache keeps parquet files as links from snapshots/ into blobs/: a directory walk reads
    each once. In the datasets cache, cache-*.arrow files (map/filter results) are left out."""
    repo = tmp_path / "hub" / "datasets--org--web"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc" / "data"
    snap.mkdir(parents=True)
    write_parquet(repo / "blobs" / "f00d", [{"text": "from the hub"}])
    (snap / "train-00000-of-00001.parquet").symlink_to(repo / "blobs" / "f00d")
    assert [d.text for d in iter_documents([str(tmp_path / "hub")])] == [b"from the hub"]

    cache = tmp_path / "cache"
    cache.mkdir()
    table = pa.Table.from_pylist([{"text": "kept"}])
    for name in ("web-train.arrow", "cache-1a2b3c.arrow"):
        with pa.ipc.new_stream(str(cache / name), table.schema) as w:
            w.write_table(table)
    with pa.ipc.new_file(str(cache / "file-format.arrow"), table.schema) as w:  # the IPC file format reads too
        w.write_table(pa.Table.from_pylist([{"text": "file"}]))
    assert [d.text for d in iter_documents([str(cache)])] == [b"file", b"kept"]


def test_a_large_parquet_file_is_read_in_row_group_units_with_the_same_documents(tmp_path):
    rows = [{"text": f"document {i} " + "x" * (i % 50)} for i in range(300)]
    path = write_parquet(tmp_path / "big.parquet", rows, row_group_size=40)  # 8 row groups
    units = units_of([path], unit_bytes=1)  # every row group its own unit
    assert units == [Unit(path, (k, k + 1)) for k in range(8)]
    assert units_of([path]) == [Unit(path)]  # small on disk: whole
    from megatok.data.documents import unit_documents

    docs = [d for u in units_of([path], unit_bytes=3000) for d in unit_documents(u)]
    assert len(units_of([path], unit_bytes=3000)) > 1
    assert docs == list(iter_documents([path]))
    assert [d.source for d in docs] == [f"{path}:row{i}" for i in range(300)]


def inputs_of_every_kind(tmp_path) -> list[str]:
    texts = stdlib_texts(n_files=40, max_bytes=6000)
    langs = ["en", "fr", "ru", None]
    records = [{"text": t, "lang": langs[i % 4], "domain": "code" if i % 3 else "prose"} for i, t in enumerate(texts)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(jsonl_bytes(records[:10]))
    write_zst(tmp_path / "in" / "b.jsonl.zst", jsonl_bytes(records[10:20]), frames=2)
    write_parquet(tmp_path / "in" / "c.parquet", records[20:35], row_group_size=3)
    (tmp_path / "in" / "d.txt").write_text(texts[-1] * 3)  # split at max_doc_bytes
    return [str(tmp_path / "in")]


def shard_files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_a_parallel_build_writes_the_shards_of_a_one_process_build(tmp_path, monkeypatch):
    """Worker processes read units (here the parquet file in row-group units too) and write shards;
    the documents are numbered and shuffled in input order, so every tar and the manifest (less its
    time stamp) are byte for byte the one-process build's, with mixture weights and split documents."""
    import megatok.data.documents as documents

    monkeypatch.setattr(documents, "UNIT_BYTES", 1000)  # read by units_of in this process
    inputs = inputs_of_every_kind(tmp_path)
    assert len(units_of(list_input_files(inputs), unit_bytes=1000)) > 4
    kw = dict(val_fraction=0.2, num_shards=5, max_doc_bytes=8000, progress=False, lang_weights={"fr": 2.5, "ru": 0},
              domain_weights={"code": 0.5}, seed=3)
    one = build_shards(inputs, str(tmp_path / "one"), **kw)
    three = build_shards(inputs, str(tmp_path / "three"), workers=3, **kw)
    assert one["split_documents"] == 1 and one["documents"]["train"] > 0 and one["documents"]["val"] > 0
    a, b = shard_files(tmp_path / "one"), shard_files(tmp_path / "three")
    assert a.keys() == b.keys() and len(a) == 5 + len(one["val"]) + 1
    assert {k: v for k, v in a.items() if k != "manifest.json"} == {k: v for k, v in b.items() if k != "manifest.json"}
    assert {**one, "created": None} == {**three, "created": None}
    # the parquet rows of every unit are there, and the ru weight 0 left none in train
    train = list(iter_shard_documents(resolve_shards(str(tmp_path / "three"), "train")))
    assert not [d for d in train if d.lang == "ru"]
    rows = {int(d.source.rsplit(":row", 1)[1]) for d in train if ".parquet:row" in d.source}
    assert min(rows) < 3 and max(rows) >= 12


def test_the_tars_are_what_webdataset_writes(tmp_path):
    """The shard writer (tarfile, so that workers need not import webdataset) writes the bytes
    webdataset's TarWriter writes for the same samples."""
    import webdataset as wds

    inputs = inputs_of_every_kind(tmp_path)
    build_shards(inputs, str(tmp_path / "out"), num_shards=2, val_fraction=0, progress=False)
    tar = tmp_path / "out" / "train-00000.tar"
    with tarfile.open(tar) as t:
        members = [(m.name, t.extractfile(m).read()) for m in t.getmembers()]
    samples = {}
    for name, data in members:
        key, ext = name.split(".", 1)
        samples.setdefault(key, {"__key__": key})[ext] = data
    with open(tmp_path / "wds.tar", "wb") as f, wds.TarWriter(f, encoder=False, mtime=0) as w:
        for sample in samples.values():
            w.write(sample)
    assert (tmp_path / "wds.tar").read_bytes() == tar.read_bytes()


def corrupt_inputs(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the error says)"""
    good = tmp_path / "good.parquet"
    write_parquet(good, [{"text": "t" * 2000, "lang": "en"}] * 50)
    data = good.read_bytes()
    out = {}
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    out["cut parquet"] = (str(tmp_path / "cut.parquet"), "not a readable parquet file")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    out["junk parquet"] = (str(tmp_path / "junk.parquet"), "not a readable parquet file")
    out["no text column"] = (write_parquet(tmp_path / "body.parquet", [{"body": "x", "lang": "en"}]),
                             'no "text" column (columns: body, lang)')
    out["int text"] = (write_parquet(tmp_path / "int.parquet", [{"text": 5}]), 'column "text" must hold strings')
    out["null text"] = (write_parquet(tmp_path / "null.parquet", [{"text": "a"}, {"text": None}]),
                        'null.parquet:row1: "text" is null')
    out["int lang"] = (write_parquet(tmp_path / "lang.parquet", [{"text": "a", "lang": 3}]),
                       'column "lang" must hold strings')
    # two frames, cut just after the first: zstandard's stream_reader would end there quietly, after
    # whole lines, and the rest of the file would be dropped without a word
    first = zstandard.ZstdCompressor().compress(jsonl_bytes([{"text": t} for t in stdlib_texts(n_files=5)]))
    (tmp_path / "cut.jsonl.zst").write_bytes(first + zstandard.ZstdCompressor().compress(b'{"text": "more"}\n')[:8])
    out["cut zst"] = (str(tmp_path / "cut.jsonl.zst"), "corrupt zstd file")
    (tmp_path / "junk.jsonl.zst").write_bytes(b"not zstd data at all")
    out["junk zst"] = (str(tmp_path / "junk.jsonl.zst"), "corrupt zstd file")
    write_zst(tmp_path / "notext.jsonl.zst", jsonl_bytes([{"content": "x"}]))
    out["no text field"] = (str(tmp_path / "notext.jsonl.zst"), 'notext.jsonl.zst:1: missing "text" field')
    (tmp_path / "junk.arrow").write_bytes(b"ARROW1 but not really")
    out["junk arrow"] = (str(tmp_path / "junk.arrow"), "not a readable Arrow file")
    return out


def test_bad_files_are_one_data_error_naming_the_file(tmp_path):
    for name, (path, says) in corrupt_inputs(tmp_path).items():
        with pytest.raises(DataError) as info:
            list(iter_documents([path]))
        message = str(info.value)
        assert message.startswith(path) and says in message and "\n" not in message, (name, message)


def test_bad_files_in_a_parallel_build_are_the_same_one_line(tmp_path):
    """Through the command, with worker processes reading: exit 2, one "error:" line naming the first
    bad file in input order, no traceback; a corrupt file is found whichever worker reads it."""
    (tmp_path / "bad").mkdir()
    bad = corrupt_inputs(tmp_path / "bad")
    good = [write_parquet(tmp_path / f"ok{k}.parquet", [{"text": f"fine {k}"}]) for k in range(3)]
    for name in ("cut parquet", "cut zst", "no text column"):
        path, says = bad[name]
        r = run_tool("build_shards", *good, path, "--out", tmp_path / "out", "--workers", "2", "--no-progress")
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {path}"), r.stderr
        assert says in lines[0] and "Traceback" not in r.stderr
        assert not (tmp_path / "out").exists()


def test_cli_fields_and_workers(tmp_path):
    path = write_parquet(tmp_path / "fw.parquet", [dict(r, text=r["text"] or "x") for r in RECORDS])
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "megatok.cli.build_shards", path, "--out", out, "--lang-field",
                        "language", "--domain-field", "meta.source", "--lang", "und", "--workers", "2",
                        "--val-fraction", "0", "--no-progress"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "4 documents" in r.stdout and "MB/s of input with 2 worker(s)" in r.stdout
    m = read_manifest(str(out))
    assert m["fields"] == {"text": "text", "lang": "language", "domain": "meta.source"}
    docs = sorted((d.text, d.lang, d.domain) for d in iter_shard_documents(resolve_shards(str(out), "train")))
    assert docs == sorted(EXPECTED + [(b"x", "en", "web")])
