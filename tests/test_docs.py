"""The documentation holds together: every relative link in every markdown file of the repository
leads to a file (and, for a link into a markdown file, a heading) that exists; every repository path the
prose names exists; nothing cites a path outside the repository; the README's Python example runs on a
trained run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

from tests.conftest import ROOT

SKIP_DIRS = {".git", ".venv", "data", "runs", "wandb", "node_modules", "__pycache__", ".pytest_cache"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def repo_files() -> list[Path]:
    """The repository's files: what git tracks or would track (not what .gitignore leaves out); without
    git, every file outside the usual generated directories."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=60).stdout
        return sorted(ROOT / line for line in out.splitlines() if (ROOT / line).is_file())
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in ROOT.rglob("*")
                      if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts)
                      and not any(part.endswith(".egg-info") for part in p.parts))


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, inline code removed."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield n, re.sub(r"`[^`]*`", "", line)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip()).lower()
    text = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        if m := re.match(r"#{1,6}\s+(.*)", line):
            a = anchor(m.group(1))
            out.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return out


def test_every_relative_link_in_the_markdown_resolves():
    markdown = [p for p in repo_files() if p.suffix == ".md"]
    assert ROOT / "README.md" in markdown and len(markdown) > 5
    broken = []
    for md in markdown:
        for n, line in prose_lines(md.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                where = f"{md.relative_to(ROOT)}:{n}: {target}"
                path, _, frag = target.partition("#")
                dest = (md.parent / path).resolve() if path else md
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif not dest.is_relative_to(ROOT):
                    broken.append(f"{where} (outside the repository)")
                elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                    broken.append(f"{where} (no heading #{frag} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


#: a repository path as prose names it (placeholders: <gpu>, NAME, METHOD)
REPO_PATH = re.compile(r"(?<![\w./-])((?:megatok|tests|tools|configs|launch|docs|\.ci)/(?:[\w./-]|<\w+>)*[\w>])")


def named_paths(text: str):
    """(line number, path) of every repository path named outside code blocks (inline code included:
    prose names files there); code blocks, fenced or indented, are commands whose outputs need not exist."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            yield from ((n, p) for p in REPO_PATH.findall(line))


def test_every_repository_path_the_prose_names_exists():
    """A file that moved leaves no pointer behind: a path (or an output prefix such as docs/results/boundaries
    for .png and .html, or a pattern with a placeholder) must match a file of the repository."""
    names = {str(p.relative_to(ROOT)) for p in repo_files()}
    dirs = {str(parent) for n in names for parent in Path(n).parents}
    missing = []
    for md in (p for p in repo_files() if p.suffix == ".md"):
        for n, path in named_paths(md.read_text()):
            parts = re.split(r"(<\w+>|[A-Z]{2,})", path.rstrip("/"))  # placeholders at odd places
            rx = re.compile("".join(".+" if i % 2 else re.escape(p) for i, p in enumerate(parts)) + r"(\..+)?$")
            if not any(rx.match(x) for x in names | dirs):
                missing.append(f"{md.relative_to(ROOT)}:{n}: {path}")
    assert len(missing) == 0, "paths named in the docs that the repository lacks:\n" + "\n".join(missing)


def test_nothing_cites_a_path_outside_the_repository():
    # built from pieces so that this file does not match itself
    patterns = ["/" + "work/", "shared/" + "design"]
    hits = []
    for path in repo_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # images, archives
        for n, line in enumerate(text.splitlines(), 1):
            if any(p in line for p in patterns):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_the_readme_python_example_runs(tiny_run, tmp_path):
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == 1 and "runs/my-run" in blocks[0]
    code = blocks[0].replace("runs/my-run", str(tiny_run))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[-2].endswith("bits/byte") and re.fullmatch(r"\d+ chunks started in \d+ bytes", out[-1]), r.stdout


def test_no_readme_paragraph_a_newcomer_must_wade_through():
    """README.md: no paragraph of prose over 120 words (code blocks, tables and headings aside)."""
    paragraphs, lines, fence = [], [], False
    for line in (ROOT / "README.md").read_text().splitlines() + [""]:
        if line.startswith("```"):
            fence, lines = not fence, []
        elif fence:
            continue
        elif not line.strip() or line.startswith(("|", "#")):
            if lines:
                paragraphs.append(" ".join(lines))
            lines = []
        else:
            lines.append(line)
    long = [(len(p.split()), p[:60]) for p in paragraphs if len(p.split()) > 120]
    assert long == [] and len(paragraphs) > 10
