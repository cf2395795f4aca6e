"""megatok-compare: the table and plots from fake run directories, and a real tiny run evaluated per
language on a small parallel held-out file, next to a BPE tokenizer's bytes per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatok import bpe
from tests.conftest import PARALLEL, run_tool, stdlib_texts

from megatok.cli import compare

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(path: Path, config: dict, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fake_runs(tmp_path: Path) -> tuple[Path, Path]:
    """A megatok policy run (FLOPs from megatok.flops) and a BPE token-model run that logs cumulative
    FLOPs and bytes per token."""
    policy = fake_run(tmp_path / "policy", {
        "model": {"kind": "unet", "d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_main_layers": 1,
                  "n_decoder_layers": 1},
        "boundary": {"strategy": "policy", "target_rate": 0.25},
        "data": {"seq_len": 64}, "train": {"micro_batch_size": 2, "global_batch_size": 4, "grad_accum": 2,
                                           "max_steps": 20}},
        [{"step": s, "split": "train", "bpb": 8 - s / 10, "boundary_rate": 0.24, "bytes_seen": s * 256}
         for s in range(1, 21)]
        + [{"step": s, "split": "val", "val_bpb": 7 - s / 10, "val_bytes_per_chunk": 4.1, "val_boundary_rate": 0.244,
            "boundary_rule": "sample(seed=1234)"} for s in (10, 20)])
    token = fake_run(tmp_path / "bpe", {"model": {"kind": "bpe", "vocab_size": 4096, "tokenizer": "tok.model",
                                             "bytes_per_token": 3.5, "n_encoder_layers": 0, "n_decoder_layers": 0},
                                   "data": {"seq_len": 64}},
                     [{"step": s, "split": "train", "bytes_seen": s * 300, "flops": s * 300 * 1e6} for s in (5, 10, 15)]
                     + [{"step": s, "split": "val", "val_bpb": 6 - s / 10, "val_bytes_per_token": 3.5} for s in (5, 12, 15)])
    return policy, token


def test_fake_runs_table_and_plots(tmp_path):
    policy, token = fake_runs(tmp_path)
    out = tmp_path / "cmp"
    assert compare.main([str(policy), str(token), "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines() if line.startswith("| policy") or line.startswith("| bpe")}
    assert rows["policy"][:3] == ["unet/policy", "20", "5,120"]
    assert rows["policy"][4:] == ["5.0000", "4.10 (chunk)", "0.244"]
    assert rows["bpe"][:3] == ["bpe", "15", "4,500"]
    assert rows["bpe"][3] == "4.5e+09"  # logged cumulative FLOPs
    assert rows["bpe"][4:] == ["4.5000", "3.50 (token)", "-"]
    for name in ("val_bpb_vs_bytes.png", "val_bpb_vs_flops.png"):
        assert (out / name).read_bytes().startswith(PNG)
    result = json.loads((out / "compare.json").read_text())
    pol, tok = result["runs"]
    # policy: FLOPs from megatok.flops at the realised rate (mean of the training rows) x bytes
    from megatok import flops
    from megatok.run.reader import run_config
    fpb = flops.flops_per_byte(run_config(policy), rate=0.24)["training"]
    assert pol["flops_source"] == "megatok.flops" and pol["flops"] == pytest.approx(fpb * 20 * 256)
    assert [p["bytes"] for p in pol["curve"]] == [2560, 5120]
    # step 12 has no train row: the FLOPs per byte logged at step 10 x the bytes at 12 (12 x 300)
    assert tok["flops_source"] == "logged" and [p["flops"] for p in tok["curve"]] == pytest.approx([1.5e9, 3.6e9, 4.5e9])


def test_mixture_runs_get_a_table_and_plot_by_source(tmp_path):
    def mixture_run(name, web_bpb):
        val = [{"step": s, "split": "val", "val_bpb": 5 - s / 10,
                "by_source": {"data/web": {"val_bpb": web_bpb - s / 10}, "data/code": {"val_bpb": 3 - s / 10}}}
               for s in (10, 20)]
        return fake_run(tmp_path / name, {"model": {"kind": "unet"}, "data": {"seq_len": 64}},
                        [{"step": s, "split": "train", "bytes_seen": s * 100} for s in (10, 20)] + val)

    policy, token = fake_runs(tmp_path)  # no mixture: blank cells
    out = tmp_path / "cmp"
    assert compare.main([str(mixture_run("web-heavy", 4)), str(mixture_run("code-heavy", 6)), str(policy),
                         "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "| run | data/web | data/code |" in md
    assert "| web-heavy | 2.0000 | 1.0000 |" in md and "| code-heavy | 4.0000 | 1.0000 |" in md
    assert "| policy | - | - |" in md
    assert (out / "val_bpb_by_source.png").read_bytes().startswith(PNG)
    saved = json.loads((out / "compare.json").read_text())
    assert saved["runs"][0]["curve"][0]["by_source"] == {"data/web": 3.0, "data/code": 2.0}
    assert "val_bpb_by_source.png" in saved["plots"]


def test_runs_without_val_rows_and_configs_that_do_not_load(tmp_path, capsys):
    odd = fake_run(tmp_path / "odd", {"model": {"kind": "unet"}}, [{"step": 2, "split": "train", "bytes_seen": 100}])
    policy, _ = fake_runs(tmp_path)
    out = tmp_path / "cmp"
    assert compare.main([str(odd), str(policy), "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "odd: no validation rows yet" in md
    assert (out / "val_bpb_vs_bytes.png").is_file() and (out / "val_bpb_vs_flops.png").is_file()
    # only runs without validation rows: no plot
    out2 = tmp_path / "cmp2"
    assert compare.main([str(odd), "--out", str(out2)]) == 0
    assert not (out2 / "val_bpb_vs_flops.png").exists() and not (out2 / "val_bpb_vs_bytes.png").exists()
    # a run's config is read as megatok reads it (megatok.run.reader): one that does not load is named
    capsys.readouterr()
    bad = fake_run(tmp_path / "bad", {"model": {"kind": "mystery"}}, [{"step": 2, "split": "train"}])
    assert compare.main([str(bad), str(policy), "--out", str(tmp_path / "cmp3")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad / 'config.json'}: model.kind: ") and "\n" not in err


def test_bad_input_is_one_error_line(tmp_path):
    r = run_tool("compare", tmp_path / "nope", "--out", tmp_path / "o")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {tmp_path / 'nope'}: not a run directory (no config.json)"]
    policy, _ = fake_runs(tmp_path)
    r = run_tool("compare", policy, "--out", tmp_path / "o", "--heldout", tmp_path / "missing.jsonl")
    assert r.returncode == 2 and "missing.jsonl" in r.stderr and "Traceback" not in r.stderr


def test_runs_of_the_same_name_are_told_apart(tmp_path):
    a, _ = fake_runs(tmp_path / "short")
    b, _ = fake_runs(tmp_path / "long")
    out = tmp_path / "cmp"
    assert compare.main([str(a), str(b), "--out", str(out)]) == 0
    names = [r["name"] for r in json.loads((out / "compare.json").read_text())["runs"]]
    assert names == ["short/policy", "long/policy"]
    assert "| short/policy | unet/policy |" in (out / "compare.md").read_text()


def test_heldout_without_languages_and_a_bpe_run_without_its_tokenizer_fail_first(tmp_path, capsys):
    policy, _ = fake_runs(tmp_path)
    nolang = tmp_path / "nolang.jsonl"
    nolang.write_text(json.dumps({"text": "no language here"}) + "\n")
    out = tmp_path / "cmp"
    assert compare.main([str(policy), "--out", str(out), "--heldout", str(nolang)]) == 2
    assert f'{nolang}: no document has a "lang"' in capsys.readouterr().err
    # a BPE run whose tokenizer is gone: refused, naming the run, before anything is evaluated or written
    token = fake_run(tmp_path / "tok-run", {"model": {"kind": "bpe", "tokenizer": str(tmp_path / "gone"),
                                                      "vocab_size": 512, "bytes_per_token": 3.0,
                                                      "n_encoder_layers": 0, "n_decoder_layers": 0}},
                     [{"step": 1, "split": "train", "bytes_seen": 100}])
    (token / "checkpoints").mkdir()
    (token / "checkpoints" / "latest").write_text("step00000001")
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"text": "hello", "lang": "en"}) + "\n")
    assert compare.main([str(policy), str(token), "--out", str(out), "--heldout", str(heldout)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {token}: model.tokenizer: ") and "gone" in err
    assert not out.exists()


def test_real_run_per_language(tiny_run, tmp_path):
    heldout = tmp_path / "parallel.jsonl"
    with heldout.open("w") as f:
        for lang, texts in PARALLEL.items():
            for i, t in enumerate(texts):
                f.write(json.dumps({"text": t, "lang": lang, "domain": "legal", "source": f"{lang}#{i}"},
                                   ensure_ascii=False) + "\n")
    tok = tmp_path / "tokenizer"
    bpe.train_bpe([t.encode() for t in stdlib_texts(n_files=5)] + [" ".join(PARALLEL["en"]).encode()], tok, 400)
    _, token = fake_runs(tmp_path / "fake")  # a run without a checkpoint: in the table, not evaluated
    out = tmp_path / "cmp"
    r = run_tool("compare", tiny_run, token, "--out", out, "--heldout", heldout, "--tokenizer", tok / "tokenizer.model")
    assert r.returncode == 0, r.stderr[-3000:]
    md = (out / "compare.md").read_text()
    assert "| tiny | unet/policy | 3 |" in md
    assert "3 languages, 2 documents per language (the same number in every language)" in md
    assert "bpe: no checkpoint, not evaluated per language" in md
    lang_rows = [line for line in md.splitlines() if line.startswith(("| en ", "| ru ", "| zh ", "| **max/min**"))]
    assert len(lang_rows) == 8  # two tables: 3 languages + the disparity row each
    text = (out / "compare.json").read_text()
    assert "NaN" not in text  # the tokenizer-only system has no bpb: its disparity is null, for strict parsers
    result = json.loads(text)
    h = result["heldout"]
    assert h["languages"] == ["en", "ru", "zh"]
    assert h["bytes"] == {lang: sum(len(t.encode()) for t in texts) for lang, texts in PARALLEL.items()}
    megatok_sys, bpe_sys = h["systems"]
    assert megatok_sys["name"] == "tiny" and megatok_sys["unit"] == "chunk"
    assert bpe_sys["name"] == "BPE" and bpe_sys["unit"] == "token"
    # the per-language figures are megatok-evaluate's on the same file (same seed and rule)
    ev = run_tool("evaluate", "--run", tiny_run, "--data", heldout)
    assert ev.returncode == 0, ev.stderr[-2000:]
    ev = json.loads(ev.stdout)
    for lang in PARALLEL:
        m = megatok_sys["by_lang"][lang]
        assert m["bpb"] == pytest.approx(ev["by_lang"][lang]["bpb"], rel=1e-6)
        assert m["bytes_per_unit"] == pytest.approx(ev["by_lang"][lang]["bytes_per_chunk"], rel=1e-6)
        assert m["units"] == pytest.approx(m["bytes"] / m["bytes_per_unit"])
    d = megatok_sys["disparity"]
    per = [megatok_sys["by_lang"][lang]["bytes_per_unit"] for lang in PARALLEL]
    assert d["bytes_per_unit"] == pytest.approx(max(per) / min(per))
    # the tokenizer's bytes per token per language, counted here with the library
    sp = bpe.load_tokenizer(tok)
    for lang, texts in PARALLEL.items():
        n_tokens = sum(len(bpe.encode_bytes(sp, t.encode())) for t in texts)
        assert bpe_sys["by_lang"][lang]["units"] == pytest.approx(n_tokens)
    # English was in the tokenizer's training text, Chinese was not: fewer bytes per token in zh
    assert bpe_sys["by_lang"]["en"]["bytes_per_unit"] > bpe_sys["by_lang"]["zh"]["bytes_per_unit"]
    assert bpe_sys["disparity"]["bytes_per_unit"] > 1
    for name in ("val_bpb_vs_bytes.png", "val_bpb_vs_flops.png"):
        assert (out / name).read_bytes().startswith(PNG)
