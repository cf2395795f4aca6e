"""Exports the ecosystem opens: the BPE token model as a transformers Llama checkpoint with equal logits and
tokenizer ids, sharded safetensors for the byte model, DeepSpeed's own zero_to_fp32.py on a megatok
checkpoint, and the merge's peak host memory against DeepSpeed's whole-model merge."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import megatok
from megatok.run.checkpoints import checkpoint_dir, latest_tag
from megatok.run.export import export
from megatok.run.merge import checkpoint_tensors
from tests.conftest import PARALLEL, ROOT, TOOL_ENV, run_tool, stdlib_texts

TEXTS = [" ".join(v) for v in PARALLEL.values()] + [stdlib_texts(n_files=1)[0][:2000], "  x\t\ty\n\n  é ﬁ 日本 "]


def assert_same_weights(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_transformers_opens_the_exported_token_model_with_megatoks_logits(bpe_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out = export(bpe_run, tmp_path / "hf", max_shard_size=60_000)  # a few shards
    info = json.loads((out / "export.json").read_text())
    assert info["format"] == "llama" and info["shards"] > 1 and (out / "model.safetensors.index.json").is_file()
    card = (out / "README.md").read_text()  # the model card
    assert "a BPE token model" in card and "AutoModelForCausalLM.from_pretrained" in card and "trust_remote" not in card
    ours = megatok.load(bpe_run)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert isinstance(hf, LlamaForCausalLM) and not hf.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS + ["x </s> y", "<s>hi <unk>"]:  # the special tokens' names in a text are plain text
        ids = tok(text)["input_ids"]  # </s> first: megatok's document separator
        assert ids == ours.encoding.doc_ids(text.encode()).tolist(), text[:40]
        assert tok.decode(ids, skip_special_tokens=True) == text
        x = torch.tensor([ids[:ours.seq_len]])
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ours.module(x).logits, rtol=0, atol=1e-4)
    # and megatok reads the same directory back: the same model
    again = megatok.load(out)
    assert again.kind == "bpe" and again.checkpoint is None
    assert again.score(TEXTS[0]).logprob == pytest.approx(ours.score(TEXTS[0]).logprob, abs=1e-4)


def test_the_byte_model_exports_sharded_and_loads_back(tiny_run, tmp_path):
    r = run_tool("export", "--run", tiny_run, "--out", tmp_path / "unet", "--max-shard-size", "40000")
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "unet"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert json.loads((out / "config.json").read_text())["model_type"] == "megatok_byte"  # transformers' (remote code)
    umask = os.umask(0)
    os.umask(umask)  # every file of the export is readable as any new file is (safetensors alone writes 0600)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {f.name: 0o666 & ~umask for f in out.iterdir()}
    merged = {k: v.load() for k, v in checkpoint_tensors(checkpoint_dir(tiny_run) / latest_tag(tiny_run)).items()}
    stored = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    assert_same_weights(stored, merged)
    run, exp = megatok.load(tiny_run), megatok.load(out)
    assert exp.score(TEXTS[0]) == run.score(TEXTS[0])
    # bf16: stored in bf16, computed in the dtype asked for
    assert run_tool("export", "--run", tiny_run, "--out", tmp_path / "bf16", "--dtype", "bf16").returncode == 0
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["head.weight"].dtype == torch.bfloat16
    assert {p.dtype for p in megatok.load(tmp_path / "bf16").module.parameters()} == {torch.float32}
    # buffers keep their dtype (the policy's delayed-start latch is a bool)
    from safetensors.torch import save_file

    from megatok.run.export import exported_config, exported_weights

    weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    save_file({**weights, "boundary.started": torch.ones((), dtype=torch.bool)},
              str(tmp_path / "bf16" / "model.safetensors"), metadata={"format": "pt"})
    lazy = exported_weights(tmp_path / "bf16", exported_config(tmp_path / "bf16"))
    assert lazy["boundary.started"].dtype == torch.bool and lazy["head.weight"].dtype == torch.bfloat16
    r = run_tool("export", "--run", tiny_run, "--out", tmp_path / "x", "--max-shard-size", "lots")
    assert r.returncode == 2 and r.stderr.strip() == ("error: --max-shard-size: 'lots' is not a size such as 5GB, "
                                                      "500MB or a number of bytes")


@pytest.mark.parametrize("kind", ["unet", "bpe"])
def test_deepspeeds_zero_to_fp32_script_runs_on_a_megatok_checkpoint(kind, tiny_run, bpe_run, tmp_path):
    """DeepSpeed writes zero_to_fp32.py into every checkpoints folder; it needs huggingface_hub to shard. It
    writes megatok's names: the byte model's export keeps them, the BPE model's export has Llama's (the
    fused q/k/v split in three), the same values after llama_names' map."""
    from megatok.run.export import exported_config, llama_names

    run = tiny_run if kind == "unet" else bpe_run
    script = checkpoint_dir(run) / "zero_to_fp32.py"
    r = subprocess.run([sys.executable, str(script), str(checkpoint_dir(run)), str(tmp_path / "ds"),
                        "--safe_serialization"], capture_output=True, text=True, env=TOOL_ENV, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = export(run, tmp_path / "ours")
    ds, ours = load_file(str(tmp_path / "ds" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    if kind == "bpe":
        assert not set(ds) & set(ours)  # no name in common
        ds = {dst: ds[src][lo:lo + n] if n > 0 else ds[src]
              for src, parts in llama_names(exported_config(out)).items() for dst, lo, n in parts}
    assert_same_weights(ds, ours)


def merge_memory(run, path: str, dtype: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "tests/run/merge_memory.py"), str(run), "--path", path,
                        "--dtype", dtype], capture_output=True, text=True, env=TOOL_ENV, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_merge_holds_one_copy_of_the_weights_in_the_output_dtype(wide_run):
    """2 ranks, ZeRO-2: the streamed merge into a bf16 model holds about half the fp32 weights (plus a
    tensor); DeepSpeed's whole-model merge then the model (megatok's path before) held several copies."""
    new, old = merge_memory(wide_run, "load", "bf16"), merge_memory(wide_run, "old", "bf16")
    fp32 = new["weights_fp32"]
    assert fp32 > 60  # MiB: large enough to stand out of the baseline
    assert new["anon_peak"] < 0.5 * fp32 + 16, new
    assert old["anon_peak"] > 1.5 * fp32, old
    exported = merge_memory(wide_run, "export", "bf16")
    assert exported["anon_peak"] < 0.5 * fp32 + 16, exported  # one shard at a time (here, the whole model)


@pytest.mark.parametrize("kind", ["unet", "bpe"])
def test_evaluate_and_generate_read_an_export_as_they_read_its_run(kind, tiny_run, bpe_run, tmp_path, capsys):
    """megatok-evaluate and megatok-generate take an export where they take a run: the same figures and the
    same samples; a checkpoint tag given with an export, or a directory that is neither, is one line, and a
    command that reads runs only says that it was given an export."""
    from megatok.cli import evaluate, generate, show_boundaries
    from megatok.sizing import quiet_deepspeed_import

    quiet_deepspeed_import()  # its log line, were this the process's first import, would go to capsys's stdout
    run = {"unet": tiny_run, "bpe": bpe_run}[kind]
    out = tmp_path / "export"
    export(run, out)
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))

    def printed(command, *args) -> tuple[int, str, str]:
        rc = command.main([*args])
        got = capsys.readouterr()
        return rc, got.out, got.err

    rc, from_run, _ = printed(evaluate, "--run", str(run), "--data", str(data))
    rc2, from_export, _ = printed(evaluate, "--run", str(out), "--data", str(data))
    assert rc == rc2 == 0
    a, b = json.loads(from_run), json.loads(from_export)
    assert b["checkpoint"] is None and a["checkpoint"] == latest_tag(run)
    assert {k: v for k, v in a.items() if k not in ("run", "checkpoint")} == \
        {k: v for k, v in b.items() if k not in ("run", "checkpoint")}
    sample = ["--prompt", "The ", "--max-bytes", "24", "--num", "2", "--seed", "5", "--json"]
    rc, from_run, _ = printed(generate, "--run", str(run), *sample)
    rc2, from_export, err = printed(generate, "--run", str(out), *sample)
    assert rc == rc2 == 0 and from_run == from_export and "export)" in err
    for command in (evaluate, generate):
        extra = ["--data", str(data)] if command is evaluate else ["--prompt", "x"]
        rc, _, err = printed(command, "--run", str(out), "--checkpoint", "step00000001", *extra)
        assert rc == 2 and err.strip() == (f"error: {out}: an export holds one checkpoint; a checkpoint tag is for "
                                           f"a run directory")
        rc, _, err = printed(command, "--run", str(tmp_path), *extra)  # neither a run nor an export
        assert rc == 2 and err.strip().splitlines()[-1] == (
            f"error: {tmp_path}: neither a megatok run directory (config.json and checkpoints/) nor an export "
            f"(export.json and model.safetensors)")
    rc, _, err = printed(show_boundaries, "--run", str(out), "--text", "The quick brown fox")  # reads runs only
    assert rc == 2 and err.strip().splitlines()[-1] == (
        f"error: {out}: an export (megatok-export), not a run directory: this command reads runs; megatok.load, "
        f"megatok-evaluate, megatok-generate and megatok-lm-eval read exports")


def test_reading_a_checkpoint_prints_nothing_of_deepspeeds(tiny_run, tmp_path):
    """A command that merges a checkpoint, in a fresh interpreter on a machine without a GPU (no DS_ACCELERATOR
    set): no "Setting accelerator to CPU" warning and no "Loading checkpoint shards" bar, on either stream."""
    data = tmp_path / "held.jsonl"
    data.write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    env = {k: v for k, v in TOOL_ENV.items() if k != "DS_ACCELERATOR"}
    r = subprocess.run([sys.executable, "-m", "megatok.cli.evaluate", "--run", str(tiny_run), "--data", str(data)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and json.loads(r.stdout)["documents"] == 1, r.stderr[-2000:]
    assert "Setting accelerator" not in r.stderr and "Loading checkpoint shards" not in r.stderr, r.stderr[-2000:]
