"""What an export holds for transformers and the Hugging Face hub besides the weights: the byte model's
remote code, config and tokenizer (megatok/hf), and a model card (README.md) for both model kinds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatok.config import Config

HF_CODE = Path(__file__).resolve().parent.parent / "hf"
CODE_FILES = ("configuration_megatok.py", "modeling_megatok.py", "tokenization_megatok.py")
#: The strategies whose rule megatok/hf/modeling_megatok.py carries (uniform draws over the training window
#: and the BPE-boundary strategy's tokenizer are not a function the export can carry).
TRANSFORMERS_STRATEGIES = ("policy", "gumbel", "hnet", "fixed", "whitespace")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def byte_transformers_config(cfg: Config, dtype: str) -> dict:
    """config.json of a byte model's export: MegatokByteConfig's fields, with the remote code named."""
    from megatok.model.blocks import ffn_hidden

    m, b = cfg.model, cfg.boundary
    return {"architectures": ["MegatokByteForCausalLM"], "model_type": "megatok_byte",
            "auto_map": {"AutoConfig": "configuration_megatok.MegatokByteConfig",
                         "AutoModelForCausalLM": "modeling_megatok.MegatokByteForCausalLM"},
            "d_model": m.d_model, "n_heads": m.n_heads, "n_encoder_layers": m.n_encoder_layers,
            "main_width": m.main_width, "main_heads": m.main_heads, "n_main_layers": m.n_main_layers,
            "n_decoder_layers": m.n_decoder_layers, "ffn_hidden": ffn_hidden(m.d_model, m.ffn_mult, m.ffn_multiple_of),
            "main_ffn_hidden": ffn_hidden(m.main_width, m.ffn_mult, m.ffn_multiple_of), "norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "byte_window": m.byte_window, "document_mask": m.document_mask,
            "chunk_capacity": m.chunk_capacity, "strategy": b.strategy, "target_rate": b.target_rate,
            "strategy_options": b.options.model_dump(), "boundary_rule": "threshold", "boundary_seed": 0,
            "max_position_embeddings": cfg.data.seq_len, "vocab_size": 258, "sep_token_id": 256,
            "bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 257, "dtype": DTYPE_NAMES[dtype]}


def write_byte_transformers_files(cfg: Config, out: Path, dtype: str) -> bool:
    """The remote code, config.json, generation_config.json and the tokenizer's files of a byte model's
    export; False (nothing written) for a strategy the remote code does not carry."""
    if cfg.boundary.strategy not in TRANSFORMERS_STRATEGIES:
        return False
    for name in CODE_FILES:
        shutil.copyfile(HF_CODE / name, out / name)
    write_json(out / "config.json", byte_transformers_config(cfg, dtype))
    write_json(out / "generation_config.json", {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 257})
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "MegatokByteTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_megatok.MegatokByteTokenizer", None]},
        "sep_token": "<sep>", "pad_token": "<pad>", "bos_token": "<sep>", "eos_token": "<sep>",
        "model_max_length": cfg.data.seq_len, "split_special_tokens": True, "clean_up_tokenization_spaces": False})
    return True


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def heldout_bpb(run_dir: Path, step: int) -> tuple[float, int] | None:
    """(val_bpb, its step): the run's last held-out evaluation at or before ``step``, or None."""
    found = None
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if isinstance(row, dict) and row.get("split") == "val" and "val_bpb" in row and row.get("step", 0) <= step:
            found = (row["val_bpb"], row["step"])
    return found


def model_card(cfg: Config, *, run_dir: Path, tag: str, meta: dict, parameters: int, dtype: str,
               transformers: bool) -> str:
    """README.md of an export: what the model is, its shape, its training, how to load it, its licence."""
    m, name = cfg.model, Path(run_dir).name
    bpe = m.kind == "bpe"
    what = (f"a BPE token model ({m.n_main_layers} layers of width {m.main_width}, {m.vocab_size} tokens)" if bpe else
            f"a byte-level hierarchical transformer (megatok's byte U-net): a {m.n_encoder_layers}-layer byte encoder "
            f"of width {m.d_model}, a `{cfg.boundary.strategy}` boundary strategy deciding where chunks start "
            f"(target rate {cfg.boundary.target_rate:g}), a {m.n_main_layers}-layer main network of width "
            f"{m.main_width} over the chunks, and a {m.n_decoder_layers}-layer byte decoder")
    seen = (meta.get("metrics") or {}).get("bytes_seen")
    val = heldout_bpb(Path(run_dir), meta["step"])
    rows = [("model", what), ("parameters", f"{parameters:,}"), ("window", f"{cfg.data.seq_len} "
                                                                        f"{'tokens' if bpe else 'bytes'}"),
            ("trained", f"{meta['step']} steps" + (f", {seen:,.0f} bytes" if seen else "") + f" (checkpoint {tag})"),
            ("held-out bits per byte", f"{val[0]:.4f} at step {val[1]}" if val else "not evaluated"),
            ("weights", f"{dtype}, safetensors")]
    if not bpe:
        rows.append(("boundary rule", "threshold: a chunk starts where the strategy's probability is above 0.5 "
                                      "(config.json `boundary_rule`; \"sample\" draws them from `boundary_seed`)"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    if bpe or transformers:
        remote = "" if bpe else ", trust_remote_code=True"
        load = (f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"tok = AutoTokenizer.from_pretrained(\"{name}\"{remote})\n"
                f"model = AutoModelForCausalLM.from_pretrained(\"{name}\"{remote})\n"
                f"ids = tok(\"The quick brown fox\", return_tensors=\"pt\").input_ids\n"
                f"print(tok.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0], skip_special_tokens=True))\n"
                f"```\n\nWith megatok installed, `megatok.load(\"{name}\")` reads the same directory.")
    else:
        load = (f"```python\nimport megatok\n\nmodel = megatok.load(\"{name}\")\n"
                f"print(model.generate(\"The quick brown fox\", max_bytes=40).text)\n```\n\n"
                f"The `{cfg.boundary.strategy}` strategy has no transformers code: this export opens with megatok only.")
    tokens = ("sentencepiece BPE (`tokenizer.model`); every document starts with `</s>`" if bpe else
              "bytes: ids 0-255 are UTF-8 bytes, 256 the separator before every document, 257 padding")
    return (f"---\nlicense: apache-2.0\nlibrary_name: {'transformers' if bpe or transformers else 'megatok'}\n"
            f"tags:\n- megatok\n- {'bpe' if bpe else 'byte-level'}\n---\n\n# {name}\n\n"
            f"Exported by megatok from the run `{name}`.\n\n| | |\n|---|---|\n{table}\n\n"
            f"Tokens: {tokens}. The run's full configuration is `megatok.json`, where it came from `export.json`.\n\n"
            f"## Use\n\n{load}\n\n## Licence\n\nApache-2.0 (the code); the weights inherit the terms of the "
            f"text they were trained on.\n")
