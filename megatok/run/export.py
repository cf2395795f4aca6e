"""Export a trained model out of DeepSpeed's checkpoint format, and load it back.

An export directory holds the weights as safetensors, sharded Hugging Face style (``model.safetensors``,
or ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` past ``max_shard_size``),
``megatok.json`` (the run's resolved config), ``export.json`` (where it came from) and the tokenizer
the model needs, if any, so it can be moved and loaded anywhere (``megatok.load``, :func:`load_exported`).

- The BPE token model is written as a ``transformers`` Llama checkpoint (``format`` "llama"): its blocks
  are Llama's (pre-norm RMSNorm, rotary on the two halves of each head, SwiGLU, untied head, no
  biases), so ``config.json`` is a LlamaConfig, the weights carry Llama's names (megatok's fused
  q/k/v projection split in three) and the tokenizer is written for ``AutoTokenizer`` too
  (``tokenizer.json``, ``tokenizer_config.json``): ``LlamaForCausalLM.from_pretrained(dir)`` gives
  megatok's logits (tests/run/test_export.py). Its beginning-of-text token is ``</s>``, the separator
  megatok puts before every document, so ``tokenizer(text).input_ids`` are megatok's ids for a document.
- The byte U-net (``format`` "megatok") keeps megatok's parameter names, and carries its own transformers
  code (megatok/hf, copied in by megatok.run.hub): ``AutoModelForCausalLM.from_pretrained(dir,
  trust_remote_code=True)`` and its AutoTokenizer give megatok's logits with no megatok installed
  (tests/hf/test_byte_model.py), for the strategies that code carries (hub.TRANSFORMERS_STRATEGIES).

Both kinds carry a model card (README.md: what the model is, its shape, training, held-out bits per byte,
how to load it, its licence).

Weights are streamed: each tensor is merged from the ZeRO partitions, converted to the output dtype and
written with its shard before the next is read (megatok.run.merge). Loading reads only safetensors, JSON
and sentencepiece's model: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatok.config import Config
from megatok.files import umask as current_umask
from megatok.run.checkpoints import CheckpointError, read_meta
from megatok.run.hub import model_card, write_byte_transformers_files
from megatok.run.merge import LazyTensor
from megatok.run.reader import (MODEL_FILES, checkpoint_to_read, checkpoint_weights, load_model, materialise,
                                run_config, written_config)

WEIGHTS, INDEX, CONFIG, INFO, HF_CONFIG = ("model.safetensors", "model.safetensors.index.json", "megatok.json",
                                           "export.json", "config.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD = "5GB"


# ----------------------------------------------------------------------------------------- layouts

def llama_names(cfg: Config) -> dict[str, list[tuple[str, int, int]]]:
    """megatok's TokenLM parameter -> [(Llama name, first row, rows)]: the fused q/k/v projection is
    three Llama tensors (rows [0, d), [d, 2d), [2d, 3d)); every other tensor is one, whole."""
    d = cfg.model.main_width
    out = {"embed.weight": [("model.embed_tokens.weight", 0, -1)], "main_norm.weight": [("model.norm.weight", 0, -1)],
           "head.weight": [("lm_head.weight", 0, -1)]}
    for i in range(cfg.model.n_main_layers):
        src, dst = f"main.layers.{i}.", f"model.layers.{i}."
        out[src + "attn.qkv.weight"] = [(dst + f"self_attn.{p}_proj.weight", k * d, d) for k, p in enumerate("qkv")]
        for a, b in (("attn_norm", "input_layernorm"), ("attn.out", "self_attn.o_proj"),
                     ("mlp_norm", "post_attention_layernorm"), ("mlp.gate", "mlp.gate_proj"),
                     ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj")):
            out[f"{src}{a}.weight"] = [(f"{dst}{b}.weight", 0, -1)]
    return out


def llama_config(cfg: Config, dtype: str, sep: int, pad: int) -> dict:
    """The LlamaConfig of a TokenLM: megatok's blocks are Llama's (multi-head attention, no biases)."""
    from megatok.model.blocks import ffn_hidden

    m = cfg.model
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.main_width, "intermediate_size": ffn_hidden(m.main_width, m.ffn_mult, m.ffn_multiple_of),
            "num_hidden_layers": m.n_main_layers, "num_attention_heads": m.main_heads,
            "num_key_value_heads": m.main_heads, "head_dim": m.main_width // m.main_heads, "hidden_act": "silu",
            "max_position_embeddings": cfg.data.seq_len, "rms_norm_eps": m.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}, "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": m.init_std,
            "bos_token_id": sep, "eos_token_id": sep, "pad_token_id": pad,
            "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]}


def _planned(cfg: Config, weights: dict[str, LazyTensor], fmt: str) -> list[tuple[str, str, int, int]]:
    """[(stored name, source name, first row, rows)] in the model's order."""
    if fmt == "megatok":
        return [(name, name, 0, -1) for name in weights]
    names = llama_names(cfg)
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"not a TokenLM checkpoint: {', '.join(unknown[:4])} has no Llama name")
    return [(dst, src, lo, n) for src in weights for dst, lo, n in names[src]]


# ----------------------------------------------------------------------------------------- export

def export(run_dir: str | Path, out_dir: str | Path, *, dtype: str = "fp32", tag: str | None = None,
           max_shard_size: str | int = DEFAULT_SHARD) -> Path:
    """Write the export of ``run_dir``'s checkpoint ``tag`` (default: latest); returns out_dir."""
    from huggingface_hub import split_torch_state_dict_into_shards

    run_dir, out_dir = Path(run_dir), Path(out_dir).absolute()  # "." has no name to put NAME.tmp next to
    check_out_dir(out_dir)
    cfg = run_config(run_dir)
    tag = checkpoint_to_read(run_dir, tag)
    weights = checkpoint_weights(run_dir, tag, cfg)
    fmt = "llama" if cfg.model.kind == "bpe" else "megatok"
    plan = _planned(cfg, weights, fmt)
    out_dtype = DTYPES[dtype]

    def stored_shape(src, n):
        shape = weights[src].shape
        return shape if n < 0 else torch.Size([n, *shape[1:]])

    def stored_dtype(src):
        return out_dtype if weights[src].dtype.is_floating_point else weights[src].dtype

    empty = {dst: torch.empty(stored_shape(src, n), dtype=stored_dtype(src), device="meta") for dst, src, _, n in plan}
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    where = {dst: (src, lo, n) for dst, src, lo, n in plan}
    umask = current_umask()
    held: tuple[str, torch.Tensor] | None = None  # the last source tensor read (q, k and v share one)
    for filename, names in split.filename_to_tensors.items():
        shard = {}
        for dst in names:
            src, lo, n = where[dst]
            if held is None or held[0] != src:
                held = (src, weights[src].load(stored_dtype(src)))
            value = held[1] if n < 0 else held[1][lo:lo + n]
            shard[dst] = value.contiguous()
        save_file(shard, str(tmp / filename), metadata={"format": "pt", "megatok_tag": tag})
        os.chmod(tmp / filename, 0o666 & ~umask)  # safetensors writes 0600: readable as the export's other files
        del shard
    held = None
    if split.is_sharded:
        (tmp / INDEX).write_text(json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename},
                                            indent=2) + "\n")
    raw = cfg.to_dict()
    for (section, key), name in zip(MODEL_FILES, ("tokenizer.model", "boundary.model")):
        if raw[section].get(key):  # the run's tokenizer, copied in: the export does not depend on its path
            src = Path(raw[section][key])
            shutil.copyfile(src / "tokenizer.model" if src.is_dir() else src, tmp / name)
            raw[section][key] = name
    (tmp / CONFIG).write_text(json.dumps(raw, indent=2) + "\n")
    transformers = fmt == "llama"
    if fmt == "llama":
        _write_llama_files(cfg, tmp, dtype)
    else:
        transformers = write_byte_transformers_files(cfg, tmp, dtype)
    meta = read_meta(run_dir, tag)
    parameters = sum(w.numel for w in weights.values())
    (tmp / "README.md").write_text(model_card(cfg, run_dir=run_dir, tag=tag, meta=meta, parameters=parameters,
                                              dtype=dtype, transformers=transformers))
    (tmp / INFO).write_text(json.dumps({"format": fmt, "run_dir": str(run_dir), "tag": tag, "step": meta["step"],
                                        "dtype": dtype, "parameters": parameters, "transformers": transformers,
                                        "shards": len(split.filename_to_tensors)}, indent=2) + "\n")
    _publish(tmp, out_dir)
    return out_dir


def _write_llama_files(cfg: Config, out: Path, dtype: str) -> None:
    """config.json, generation_config.json and the tokenizer files transformers reads."""
    from transformers import LlamaTokenizer

    from megatok.data.encoding import BpeEncoding

    enc = BpeEncoding(str(out / "tokenizer.model"))
    (out / HF_CONFIG).write_text(json.dumps(llama_config(cfg, dtype, enc.sep, enc.pad), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": enc.sep, "eos_token_id": enc.sep, "pad_token_id": enc.pad}, indent=2) + "\n")
    sp = enc._processor()
    # converted from tokenizer.model (transformers reads sentencepiece's protobuf: protobuf is a requirement);
    # megatok's sentencepiece contract: no dummy prefix, byte fallback; every document starts with </s>
    tok = LlamaTokenizer.from_pretrained(str(out), add_prefix_space=False, legacy=False,
                                         bos_token=sp.id_to_piece(enc.sep), eos_token=sp.id_to_piece(enc.sep),
                                         unk_token=sp.id_to_piece(sp.unk_id()), pad_token=sp.id_to_piece(enc.pad),
                                         add_bos_token=True, add_eos_token=False,
                                         split_special_tokens=True)  # "</s>" in a text is its bytes, as in megatok
    tok.save_pretrained(str(out))


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished export into place: an empty directory is filled, an earlier export replaced."""
    old = out_dir.with_name(out_dir.name + f".old-{os.getpid()}")
    if out_dir.is_dir() and not any(out_dir.iterdir()):  # an empty directory (--out .) is filled, not replaced
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
        tmp.rmdir()
        return
    if out_dir.exists():  # an earlier export: moved aside first (killed in between, NAME.old-PID holds it)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def is_export(path: str | Path) -> bool:
    """An export directory: export.json, megatok.json and the weights (one file or an index of shards)."""
    path = Path(path)
    return (path / INFO).is_file() and (path / CONFIG).is_file() and ((path / WEIGHTS).is_file() or (path / INDEX).is_file())


def check_out_dir(out_dir: str | Path) -> None:
    """An export replaces only an earlier export: never a file, a run or someone's notes."""
    out_dir = Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_export(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not a megatok export (no {INFO}, {WEIGHTS} and {CONFIG}); "
                              f"choose another --out or remove it")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory; choose another --out")


# ----------------------------------------------------------------------------------------- loading

def exported_config(path: str | Path) -> Config:
    """The megatok config of an export (its own tokenizer files first)."""
    path = Path(path)
    if not is_export(path):
        raise FileNotFoundError(f"{path}: not a megatok export (no {INFO} with {WEIGHTS} or {INDEX})")
    return written_config(path / CONFIG, path.resolve(), base_first=True)


#: safetensors' dtype names -> torch's (every dtype a megatok model's parameters and buffers use)
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "BOOL": torch.bool,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "F64": torch.float64}


def exported_weights(path: str | Path, cfg: Config) -> dict[str, LazyTensor]:
    """{megatok name: LazyTensor} of an export's safetensors, read a tensor at a time."""
    path = Path(path)
    if (path / INDEX).is_file():
        files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    else:
        files = [WEIGHTS]
    stored: dict[str, LazyTensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                if sl.get_dtype() not in SAFETENSORS_DTYPES:
                    raise ValueError(f"{path / name}: tensor {key}: dtype {sl.get_dtype()} is not one megatok writes")
                dtype = SAFETENSORS_DTYPES[sl.get_dtype()]
                stored[key] = LazyTensor(torch.Size(sl.get_shape()), dtype,
                                         (lambda to, file=str(path / name), key=key: _read(file, key).to(to)))
    info = json.loads((path / INFO).read_text())
    if info["format"] == "megatok":
        return stored
    out = {}
    for src, parts in llama_names(cfg).items():
        missing = [dst for dst, _, _ in parts if dst not in stored]
        if missing:
            raise ValueError(f"{path}: {missing[0]} missing from its weights")
        pieces = [stored[dst] for dst, _, _ in parts]
        if len(pieces) == 1:
            out[src] = pieces[0]
        else:
            out[src] = LazyTensor(torch.Size([sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]]), pieces[0].dtype,
                                  (lambda to, pieces=pieces: torch.cat([p.load(to) for p in pieces])))
    return out


def _read(file: str, key: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(key)


def load_exported(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """(model, config) from an export directory, ready for evaluation (eval mode), in ``dtype``
    (default fp32, whatever the stored dtype)."""
    cfg = exported_config(path)
    model = materialise(cfg, exported_weights(path, cfg), device, dtype, where=str(path))
    return model, cfg


def load_model_or_export(path: str | Path, checkpoint: str | None = None, device: str | torch.device = "cpu",
                         dtype: torch.dtype | None = None):
    """(model, config, tag) from a run directory (its checkpoint ``checkpoint``, default latest; any ZeRO stage)
    or from an export (tag None), in eval mode: what megatok.load, megatok-evaluate and megatok-generate read.
    Raises FileNotFoundError for a path that is neither, CheckpointError (one) for a checkpoint tag given with an
    export."""
    path = Path(path)
    if model_source(path) == "export":
        if checkpoint is not None:
            raise CheckpointError(f"{path}: an export holds one checkpoint; a checkpoint tag is for a run directory")
        return (*load_exported(path, device, dtype), None)
    return load_model(path, checkpoint, device, dtype)


def model_source(path: str | Path) -> str:
    """"run" or "export": what ``path`` holds, from its files alone (nothing loaded); FileNotFoundError, one
    line, for neither."""
    path = Path(path)
    if is_export(path):
        return "export"
    if (path / "config.json").is_file() and (path / "checkpoints").is_dir():
        return "run"
    raise FileNotFoundError(f"{path}: neither a megatok run directory (config.json and checkpoints/) nor an export "
                            f"(export.json and model.safetensors)")


def shard_size(text: str) -> int | str:
    """--max-shard-size: bytes, or a size such as 5GB or 500MB."""
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]i?B", text, re.I):
        return text.upper().replace(" ", "")
    raise ValueError(f"--max-shard-size: {text!r} is not a size such as 5GB, 500MB or a number of bytes")
