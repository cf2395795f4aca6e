"""megatok-train-bpe end to end: from a shard directory (train split, val as held-out) and from files."""

from __future__ import annotations

import json
import subprocess

from megatok import bpe
from megatok.data.stream import iter_shard_documents, resolve_shards
from tests.bpe.conftest import MULTILINGUAL
from tests.conftest import ROOT, run_tool


def train_bpe(*args) -> subprocess.CompletedProcess:
    return run_tool("train_bpe", *args, timeout=180)


def test_from_shards_with_heldout_file(shards, tmp_path):
    heldout = tmp_path / "heldout.jsonl"
    with heldout.open("w") as f:
        for lang, text in [("en", "All human beings are born free and equal."),
                           ("ru", "Все люди рождаются свободными и равными."), ("zh", "人人生而自由，一律平等。")]:
            f.write(json.dumps({"text": text, "lang": lang, "domain": "legal"}) + "\n")
    out = tmp_path / "bpe"
    r = train_bpe("--data", shards, "--vocab-size", 600, "--out", out, "--max-mb", 0.3, "--heldout", heldout)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train_bpe" in r.stderr  # the progress bar over the documents fed
    report = json.loads((out / "report.json").read_text())
    assert report["vocab_size"] == 600 and (out / "tokenizer.model").is_file()
    speed = report["encode_speed"]  # the data pipeline's own tokenising, timed
    assert speed["bytes"] > 0 and speed["tokens"] > 0 and speed["mb_per_s"] > 0
    train = report["train"]
    assert 300_000 <= train["bytes"] < 300_000 + 40_000  # up to the document that reaches --max-mb
    assert train["bytes_per_token"] > 2 and set(train["by_domain"]) == {"code", "prose"}
    val_bytes = sum(len(d.text) for d in iter_shard_documents(resolve_shards(str(shards), "val")))
    assert report["heldout"]["val"]["bytes"] == val_bytes  # the shard directory's val split
    h = report["heldout"][str(heldout)]
    assert set(h["by_lang"]) == {"en", "ru", "zh"}
    per = {k: v["bytes_per_token"] for k, v in h["by_lang"].items()}
    assert h["lang_disparity"] == max(per.values()) / min(per.values())
    # the figures are what the library measures with the saved model
    sp = bpe.load_tokenizer(out)
    assert h["by_lang"]["ru"]["tokens"] == len(bpe.encode_bytes(sp, "Все люди рождаются свободными и равными.".encode()))
    assert "disparity" in r.stdout


def test_from_files_small_vocab_warns(tmp_path):
    data = tmp_path / "a.txt"
    data.write_text(MULTILINGUAL * 3)
    r = train_bpe("--data", data, "--vocab-size", 5000, "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning: the text supports only" in r.stderr
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["vocab_size"] < 5000 and report["heldout"] == {}
    assert "lang_disparity" not in report["train"]  # one language (or none): no max/min, never NaN
    assert "NaN" not in (tmp_path / "o" / "report.json").read_text()
    # again into the same directory: refused (runs may use that tokenizer), unless --overwrite
    before = (tmp_path / "o" / "tokenizer.model").read_bytes()
    r = train_bpe("--data", data, "--vocab-size", 400, "--out", tmp_path / "o")
    assert r.returncode == 2 and "tokenizer.model: exists" in r.stderr and "--overwrite replaces it" in r.stderr
    assert (tmp_path / "o" / "tokenizer.model").read_bytes() == before
    r = train_bpe("--data", data, "--vocab-size", 400, "--out", tmp_path / "o", "--overwrite", "--heldout", data)
    assert r.returncode == 0 and (tmp_path / "o" / "tokenizer.model").read_bytes() != before, r.stderr[-2000:]
    assert f"warning: --heldout {data} is also in --data: trained on, so not held out" in r.stderr
    assert "reached twice" not in r.stderr


def test_bad_input_is_one_error_line(tmp_path):
    for args in (["--data", tmp_path / "missing.jsonl"], ["--data", ROOT / "README.md"]):
        r = train_bpe(*args, "--vocab-size", 300, "--out", tmp_path / "o")
        assert r.returncode == 2, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(args[1]) in errors[0] and "Traceback" not in r.stderr
        assert not (tmp_path / "o").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    r = train_bpe("--data", bad, "--vocab-size", 300, "--out", tmp_path / "o")
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr
    good = tmp_path / "good.txt"
    good.write_text(MULTILINGUAL)
    r = train_bpe("--data", good, "--vocab-size", 300, "--out", tmp_path / "o", "--heldout", bad)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()  # refused before training, not after
    r = train_bpe("--data", good, "--vocab-size", 300, "--out", tmp_path / "o.model")  # a file name, not a directory
    assert r.returncode == 2 and "--out" in r.stderr and "give the output directory" in r.stderr
    assert not (tmp_path / "o.model").exists() and "Traceback" not in r.stderr


def test_a_vocabulary_smaller_than_the_texts_characters_is_one_line_in_the_commands_terms(tmp_path):
    """sentencepiece's refusal (its C++ location, its --character_coverage) becomes megatok-train-bpe's line:
    which flag, which sizes, what to change."""
    import pytest

    text = "".join(chr(0x4E00 + i) + " " for i in range(900)).encode()
    with pytest.raises(ValueError) as e:
        bpe.train_bpe([text] * 4, tmp_path / "o", 700)
    assert str(e.value) == ("--vocab-size 700 is below the 1160 pieces it must hold (the text's characters at "
                            "--character-coverage 0.99995, the 256 byte pieces and the special ones): raise "
                            "--vocab-size, or lower --character-coverage (rarer characters then fall back to bytes)")
