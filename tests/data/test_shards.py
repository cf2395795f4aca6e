import gzip
import hashlib
import json
import os
import random
import re
from collections import Counter

import pytest

from megatok.data.documents import DataError, iter_documents
from megatok.data.shards import build_shards, read_manifest, verify_shards
from megatok.data.stream import iter_shard_documents, resolve_shards
from tests.conftest import run_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_inputs(root, n_jsonl=40, seed=0):
    """A small mixed corpus: a jsonl per language (one gzipped), a directory of .txt files, one binary file."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for lang, opener in (("en", open), ("fr", gzip.open)):
        name = root / (f"{lang}.jsonl" + (".gz" if opener is gzip.open else ""))
        with opener(name, "wt", encoding="utf-8") as f:
            for i in range(n_jsonl):
                words = " ".join(rng.choice(["alpha", "beta", "\u00e9t\u00e9", "gamma"]) for _ in range(rng.randint(1, 30)))
                f.write(json.dumps({"text": f"{lang} {i} {words}", "lang": lang, "domain": "web"}) + "\n")
            f.write(json.dumps({"text": ""}) + "\n")  # an empty document
    (root / "books").mkdir(exist_ok=True)
    for i in range(5):
        (root / "books" / f"book{i}.txt").write_bytes(f"book {i}\n".encode() * rng.randint(1, 40))
    (root / "books" / "blob.txt").write_bytes(bytes(rng.randrange(256) for _ in range(700)))
    return [str(root / "en.jsonl"), str(root / "fr.jsonl.gz"), str(root / "books")]


def shard_paths(out, manifest):
    return [os.path.join(out, e["name"]) for split in ("train", "val") for e in manifest[split]]


def test_every_document_appears_exactly_once_with_metadata(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    out = str(tmp_path / "shards")
    m = build_shards(inputs, out, val_fraction=0.1, num_shards=6, lang="und", domain="books", max_doc_bytes=200,
                     progress=False)
    expected = Counter((d.text, d.lang, d.domain, d.source)
                       for d in iter_documents(inputs, lang="und", domain="books", max_doc_bytes=200))
    got = Counter((d.text, d.lang, d.domain, d.source) for d in iter_shard_documents(shard_paths(out, m)))
    assert got == expected
    assert m["documents"]["train"] + m["documents"]["val"] == sum(expected.values())
    assert m["documents"]["val"] >= 1 and len(m["train"]) == 6 and len(m["val"]) == 1
    assert m["empty_documents_skipped"] == 2 and m["split_documents"] >= 1
    assert sorted(os.listdir(out)) == ["manifest.json", "train-00000.tar", "train-00001.tar", "train-00002.tar",
                                       "train-00003.tar", "train-00004.tar", "train-00005.tar", "val-00000.tar"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]


def test_manifest_counts_and_checksums_match_files(tmp_path):
    out = str(tmp_path / "shards")
    build_shards(make_inputs(tmp_path / "in"), out, val_fraction=0.2, num_shards=3, progress=False)
    m = read_manifest(out)
    assert m["format"] == "megatok-shards" and m["version"] == 1 and m["seed"] == 0
    for split in ("train", "val"):
        assert m["documents"][split] == sum(e["documents"] for e in m[split])
        assert m["bytes"][split] == sum(e["bytes"] for e in m[split])
        for e in m[split]:
            path = os.path.join(out, e["name"])
            assert hashlib.sha256(open(path, "rb").read()).hexdigest() == e["sha256"]
            docs = list(iter_shard_documents([path]))
            assert len(docs) == e["documents"] and sum(len(d.text) for d in docs) == e["bytes"]
    assert verify_shards(out) == []
    assert resolve_shards(out, "val") == [os.path.join(out, e["name"]) for e in m["val"]]


def test_sources_are_mixed_within_shards(tmp_path):
    out = str(tmp_path / "shards")
    build_shards(make_inputs(tmp_path / "in", n_jsonl=60), out, val_fraction=0, num_shards=2, progress=False)
    langs = [d.lang for d in iter_shard_documents(resolve_shards(out))]
    first_fr, last_en = langs.index("fr"), len(langs) - 1 - langs[::-1].index("en")
    assert first_fr < last_en  # not input order: languages interleave inside each shard


def test_build_is_deterministic(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    a = build_shards(inputs, str(tmp_path / "a"), num_shards=3, seed=5, progress=False)
    b = build_shards(inputs, str(tmp_path / "b"), num_shards=3, seed=5, progress=False)
    assert [e["sha256"] for e in a["train"] + a["val"]] == [e["sha256"] for e in b["train"] + b["val"]]


def test_val_split_edges(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a")
    (tmp_path / "b.txt").write_bytes(b"b")
    m = build_shards([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "two"),
                     val_fraction=0.001, progress=False)
    assert m["documents"] == {"train": 1, "val": 1}  # at least one of each with two documents
    m = build_shards([str(tmp_path / "a.txt")], str(tmp_path / "one"), val_fraction=0.5, progress=False)
    assert m["documents"] == {"train": 1, "val": 0} and m["val"] == [] and len(m["train"]) == 1


def test_verify_flags_a_modified_shard(tmp_path):
    out = str(tmp_path / "shards")
    m = build_shards(make_inputs(tmp_path / "in"), out, num_shards=2, progress=False)
    path = os.path.join(out, m["train"][1]["name"])
    data = bytearray(open(path, "rb").read())
    data[700] ^= 1
    open(path, "wb").write(bytes(data))
    problems = verify_shards(out)
    assert len(problems) == 1 and m["train"][1]["name"] in problems[0] and "sha256" in problems[0]
    os.remove(path)
    assert "missing" in verify_shards(out)[0]


def test_existing_output_is_refused_and_survives_a_failed_build(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    out = str(tmp_path / "shards")
    build_shards(inputs, out, num_shards=2, progress=False)
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    with pytest.raises(DataError, match="not empty"):
        build_shards(inputs, out, progress=False)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 50 + "{broken\n")
    with pytest.raises(DataError, match=r"bad.jsonl:51: invalid JSON"):
        build_shards(inputs + [str(bad)], out, overwrite=True, progress=False)
    assert {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)} == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]

    m = build_shards(inputs, out, num_shards=3, overwrite=True, progress=False)  # overwrite replaces it
    assert len(read_manifest(out)["train"]) == 3 == len(m["train"])
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]


def test_zero_documents_and_bad_manifest(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="no documents in .*empty.txt"):
        build_shards([str(tmp_path / "empty.txt")], str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(DataError, match="manifest.json: no manifest"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest.json: unreadable manifest"):
        read_manifest(str(tmp_path))


def run_cli(*args):
    return run_tool("build_shards", *args, cwd="/", timeout=120)


def test_cli(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    out = str(tmp_path / "shards")
    result = run_cli(*inputs, "--out", out, "--num-shards", "2", "--val-fraction", "0.1", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "documents" in result.stdout and "2 train + 1 val shards" in result.stdout
    assert verify_shards(out) == []

    result = run_cli(str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and "missing.jsonl" in result.stderr
    result = run_cli(*inputs, "--out", out)  # exists
    assert result.returncode == 2 and "not empty" in result.stderr and "Traceback" not in result.stderr
    result = run_cli(*inputs, "--out", os.path.join(inputs[0], "x"), "--no-progress")  # under a file
    assert result.returncode == 2 and re.fullmatch(rf"error: {re.escape(inputs[0])}/x\.tmp-\d+: Not a directory\n",
                                                   result.stderr), result.stderr


def test_overwrite_through_a_link_rebuilds_its_target(tmp_path):
    """data/shards -> /shared/shards: --overwrite replaces the shared shards and keeps the link."""
    inputs = make_inputs(tmp_path / "in")
    target, link = tmp_path / "shared" / "shards", tmp_path / "shards"
    build_shards(inputs, str(target), num_shards=1, progress=False)
    link.symlink_to(target)
    m = build_shards(inputs, str(link), num_shards=2, overwrite=True, progress=False)
    assert link.is_symlink() and os.readlink(link) == str(target) and len(m["train"]) == 2
    assert len(read_manifest(str(target))["train"]) == 2 and verify_shards(str(link)) == []
    assert sorted(os.listdir(tmp_path)) == ["in", "shards", "shared"] and os.listdir(tmp_path / "shared") == ["shards"]


def test_mixture_weights_repeat_or_thin_training_documents_only(tmp_path):
    inputs = make_inputs(tmp_path / "in", n_jsonl=200)
    plain = build_shards(inputs, str(tmp_path / "plain"), val_fraction=0.1, num_shards=4, progress=False)
    out = str(tmp_path / "mixed")
    m = build_shards(inputs, out, val_fraction=0.1, num_shards=4, progress=False, lang_weights={"fr": 3, "en": 0.5},
                     domain_weights={"web": 1.0})
    assert m["weights"] == {"lang": {"fr": 3, "en": 0.5}, "domain": {"web": 1.0}}
    assert [e["sha256"] for e in m["val"]] == [e["sha256"] for e in plain["val"]]  # the val split is untouched
    assert m["bytes_by_lang"]["val"] == plain["bytes_by_lang"]["val"]

    docs = list(iter_shard_documents([os.path.join(out, e["name"]) for e in m["train"]]))
    base = Counter((d.text, d.lang) for d in iter_shard_documents([os.path.join(str(tmp_path / "plain"), e["name"])
                                                                  for e in plain["train"]]))
    got = Counter((d.text, d.lang) for d in docs)
    assert all(got[k] == 3 for k in base if k[1] == "fr")  # every French document three times
    en_kept = [got[k] for k in base if k[1] == "en"]
    assert set(en_kept) <= {0, 1} and 0.35 < sum(en_kept) / len(en_kept) < 0.65  # about half of the English
    assert all(got[k] == 1 for k in base if k[1] is None)  # no weight: as before
    assert sum(m["bytes_by_lang"]["train"].values()) == m["bytes"]["train"] == sum(e["bytes"] for e in m["train"])
    assert m["bytes_by_lang"]["train"]["fr"] == 3 * plain["bytes_by_lang"]["train"]["fr"]
    # every copy is its own sample: unique keys, all read back
    keys = [k for e in m["train"] for k in _keys(os.path.join(out, e["name"]))]
    assert len(keys) == len(set(keys)) == len(docs) == m["documents"]["train"]
    assert build_shards(inputs, str(tmp_path / "again"), val_fraction=0.1, num_shards=4, progress=False,
                        lang_weights={"fr": 3, "en": 0.5}, domain_weights={"web": 1.0})["train"] == m["train"]

    with pytest.raises(DataError, match=r"lang weight de=2: no document has lang 'de' \(found: en, fr\)"):
        build_shards(inputs, str(tmp_path / "x"), progress=False, lang_weights={"de": 2})
    with pytest.raises(ValueError, match="lang weight fr=-1: must be a finite number >= 0"):
        build_shards(inputs, str(tmp_path / "x"), progress=False, lang_weights={"fr": -1})
    r = run_cli(*inputs, "--out", str(tmp_path / "cli"), "--num-shards", "2", "--no-progress", "--lang-weight", "fr=3")
    assert r.returncode == 0, r.stderr
    assert "train bytes by lang after the weights: " in r.stdout and "fr " in r.stdout
    r = run_cli(*inputs, "--out", str(tmp_path / "bad"), "--lang-weight", "fr:3")
    assert r.returncode == 2 and r.stderr.strip() == "error: --lang-weight fr:3: expected NAME=WEIGHT, e.g. ru=3"


def _keys(path):
    import tarfile

    with tarfile.open(path) as tar:
        return sorted({m.name.split(".")[0] for m in tar.getmembers()})


def test_a_split_document_holds_out_a_tail_of_its_pieces(tmp_path):
    """Pieces of a document cut by max_doc_bytes: its val pieces are its last ones (no val piece between
    training pieces of the same book), the fraction holds by pieces, its training pieces share its
    mixture copies, and a corpus of one large file still gets a val split."""
    rng = random.Random(1)
    with open(tmp_path / "long.jsonl", "w") as f:
        for i in range(30):
            text = "\n".join(f"doc {i} line {j} " + "x" * rng.randint(0, 40) for j in range(60))
            f.write(json.dumps({"text": text, "lang": rng.choice(["en", "fr"])}) + "\n")

    def pieces(out, m):  # {document: {piece number: (split, copies)}}
        got = {}
        for split in ("train", "val"):
            for d in iter_shard_documents([os.path.join(out, e["name"]) for e in m[split]]):
                doc, _, k = d.source.partition("#")
                got.setdefault(doc, Counter())[(int(k), split)] += 1
        return got

    out = str(tmp_path / "split")
    m = build_shards([str(tmp_path / "long.jsonl")], out, val_fraction=0.3, num_shards=2, max_doc_bytes=400,
                     progress=False, lang_weights={"fr": 1.5})
    got = pieces(out, m)
    assert m["split_documents"] == 30 and len(got) == 30
    n_val = n_all = straddling = 0
    for doc, c in got.items():
        splits = [s for _, s in sorted(c)]
        assert splits == sorted(splits, key=lambda s: s == "val"), (doc, splits)  # train pieces, then val ones
        assert len({n for (_, s), n in c.items() if s == "train"}) <= 1, c  # one copy count per document
        n_val, n_all = n_val + splits.count("val"), n_all + len({k for k, _ in c})
        straddling += len(set(splits)) == 2
    assert 0.2 < n_val / n_all < 0.4 and straddling > 0
    assert {n for c in got.values() for (_, s), n in c.items() if s == "train"} == {1, 2}  # fr: 1 or 2 copies

    (tmp_path / "book.txt").write_text("\n".join(f"line {j} " + "y" * (j % 50) for j in range(2000)))
    m = build_shards([str(tmp_path / "book.txt")], str(tmp_path / "book"), val_fraction=0.05, max_doc_bytes=2000,
                     progress=False)
    (c,) = pieces(str(tmp_path / "book"), m).values()
    k = len(c)
    assert k > 20 and 1 <= m["documents"]["val"] <= 0.05 * k + 1
    assert sorted(c) == [(i, "train") for i in range(k - m["documents"]["val"])] + [
        (i, "val") for i in range(k - m["documents"]["val"], k)]

def test_a_fractional_lang_weight_keeps_that_share_and_a_domain_weight_multiplies(tmp_path):
    """lang weight 0.2 keeps about a fifth of that language's training documents (0.5, which the
    test above uses, cannot tell a share from its complement); a domain weight of 2 repeats every
    document of the domain twice and leaves the others alone."""
    inputs = make_inputs(tmp_path / "in", n_jsonl=300)
    kw = {"val_fraction": 0.1, "num_shards": 2, "progress": False}
    plain = build_shards(inputs, str(tmp_path / "plain"), **kw)

    def counts(name, **weights):
        m = build_shards(inputs, str(tmp_path / name), **kw, **weights)
        return m, Counter((d.text, d.domain) for d in iter_shard_documents(
            [os.path.join(tmp_path, name, e["name"]) for e in m["train"]]))

    base = counts("plain2")[1]
    _, thin = counts("thin", lang_weights={"en": 0.2})
    kept = [thin[k] for k in base if k[0].startswith(b"en ")]
    assert set(kept) <= {0, 1} and 0.1 < sum(kept) / len(kept) < 0.3
    m, web = counts("web", domain_weights={"web": 2})
    assert all(web[k] == (2 if k[1] == "web" else 1) for k in base)
    assert m["bytes"]["train"] > plain["bytes"]["train"] and m["weights"]["domain"] == {"web": 2}


def test_the_val_split_follows_the_seed_and_a_small_corpus_still_gets_min_shards(tmp_path):
    inputs = make_inputs(tmp_path / "in", n_jsonl=100)

    def val_texts(seed, name):
        m = build_shards(inputs, str(tmp_path / name), val_fraction=0.2, progress=False, seed=seed)
        return m, {d.text for d in iter_shard_documents([os.path.join(tmp_path, name, e["name"]) for e in m["val"]])}

    m, zero = val_texts(0, "a")
    assert val_texts(0, "b")[1] == zero != val_texts(1, "c")[1]
    assert len(m["train"]) == 8  # min_shards: a corpus far below shard_bytes is still cut into 8 shards


def test_the_command_draws_no_progress_bar_into_a_log(tmp_path, capsys, monkeypatch):
    """megatok-build-shards draws its bars on a terminal only: written to a file or a pipe, its output holds its
    summary and no carriage-return bar (as the trainer's and megatok-make-corpus's); on a terminal it draws them,
    the reading bar ending at 100% whether the size estimate was short or long."""
    import io

    from megatok.cli import build_shards as command

    inputs = make_inputs(tmp_path / "in")
    assert command.main([*inputs, "--out", str(tmp_path / "piped")]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "reading" not in err and out.startswith(f"wrote {tmp_path / 'piped'}")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert command.main([*inputs, "--out", str(tmp_path / "tty")]) == 0
    drawn = terminal.getvalue()
    assert "reading" in drawn and "writing" in drawn
    done, total = re.search(r"([\d.]+[kMG]?)/([\d.]+[kMG]?)", drawn.split("writing")[0].split("reading")[-1]).groups()
    assert done == total, drawn[:2000]  # the reading bar ends at its total, whatever the estimate was
