"""Write the BPE token-model config that matches a megatok (unet) config in training FLOPs per byte.

    megatok-match-bpe --config configs/tiny.json --tokenizer runs/bpe4k --out configs/tiny-bpe.json
    megatok-match-bpe --config configs/1b.json --vocab-size 32000 --bytes-per-token 4.2 \\
        --tokenizer-path data/bpe32k/tokenizer.model --out configs/bpe/1b.json \\
        [--run-dir runs/1b-bpe] [--set KEY=VALUE ...]

--tokenizer takes a megatok-train-bpe output directory (or its tokenizer.model): the vocabulary size is
the tokenizer's number of pieces and bytes per token come from report.json next to it (the training-text
figure; --bytes-per-token overrides it, and is needed when there is no report). Without a tokenizer at
hand, give --vocab-size and --bytes-per-token (and --tokenizer-path, the model file the run will read).

The model keeps the unet's main head dimension; width and depth are chosen by megatok.flops.match_bpe
(FLOPs per byte within a few percent, width close to the main network's), data.seq_len becomes the
sequence's bytes / bytes_per_token tokens, model.vocab_size the pieces rounded up to a multiple of 64.
The output ``"extends"`` the source config and overrides model, data.seq_len and train.run_dir (default:
the source's run_dir + "-bpe"); --set overrides apply to the source before matching and are written
into the output too. A warning is printed when the search cannot get within 10% (e.g. a large
vocabulary on a tiny model, whose output head alone costs more than the target). Exit status 2 with one
error line on bad input.

configs/bpe/<size>.json are this tool's output for configs/<size>.json with ``--vocab-size 32000
--bytes-per-token 4.2 --tokenizer-path data/bpe32k/tokenizer.model``: an assumed tokenizer (a 32k BPE
on English-heavy web text gives roughly 4-4.5 bytes per token). Bytes per token set the token model's
FLOPs per byte and its seq_len, so regenerate them from your own tokenizer's report before training:

    megatok-train-bpe --data /data/shards --vocab-size 32768 --out data/bpe32k
    for s in 100m 350m 1b 3b 7b 13b; do
        megatok-match-bpe --config configs/$s.json --tokenizer data/bpe32k --out configs/bpe/$s.json
    done
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megatok import flops
from megatok.bpe import tokenizer_facts
from megatok.config import ConfigError, find_config, load_config, merge, overrides_dict


def matched(config: str, out: str, *, tokenizer: str | None = None, vocab_size: int | None = None,
            bytes_per_token: float | None = None, tokenizer_path: str | None = None, rate: float | None = None,
            run_dir: str | None = None, overrides: list[str] = ()) -> tuple[dict, dict, object, int]:
    """(the output config dict, match_bpe's result, source config, the tokenizer's pieces)."""
    src = find_config(config)
    if not src.is_file():
        raise ConfigError(f"--config {src}: file not found")
    cfg = load_config(src, list(overrides), world_size=1)
    if tokenizer:
        model_path, pieces, bpt = tokenizer_facts(tokenizer)
        if bytes_per_token is not None:
            bpt = bytes_per_token
        if bpt is None:
            raise ConfigError(f"--tokenizer {tokenizer}: no report.json with bytes per token next to it; "
                              "give --bytes-per-token")
    else:
        if vocab_size is None or bytes_per_token is None:
            raise ConfigError("give --tokenizer DIR, or --vocab-size and --bytes-per-token")
        model_path, pieces, bpt = tokenizer_path, vocab_size, bytes_per_token
    if pieces <= 0 or bpt <= 0:
        raise ConfigError(f"vocabulary size and bytes per token must be positive (got {pieces}, {bpt})")
    match = flops.match_bpe(cfg, tokenizer=model_path, vocab_size=pieces, bytes_per_token=bpt, rate=rate)
    rel = os.path.relpath(src.resolve(), Path(out).parent.resolve())
    raw = merge(overrides_dict(list(overrides)), match["overrides"])
    raw = merge(raw, {"train": {"run_dir": run_dir or cfg.train.run_dir + "-bpe"}})
    written = {"extends": rel, **raw}
    return written, match, cfg, pieces


def extends_chain(path: Path) -> list[Path]:
    """A config file and those it extends, resolved (a config that loads: no cycle, every file there)."""
    chain = []
    while path is not None and path.resolve() not in chain:
        chain.append(path.resolve())
        parent = json.loads(path.read_text()).get("extends")
        path = path.resolve().parent / parent if parent else None
    return chain


def write_matched(config: str, out: str, **given) -> None:
    """What megatok-match-bpe does: the config matched to ``config`` (``given``: :func:`matched`'s keywords)
    written to ``out``, where only a config that loads replaces an earlier file, and the two shapes printed
    side by side. ConfigError or OSError (one line) on bad input, before anything is written."""
    out = Path(out)
    written, match, src_cfg, pieces = matched(config, out, **given)
    if out.resolve() in extends_chain(find_config(config)):
        raise ConfigError(f"--out {out}: that is {config} or a config it extends, which the matched "
                          f"config extends in turn; write it to another file")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # next to it: the same relative 'extends'
    try:
        tmp.write_text(json.dumps(written, indent=2) + "\n")
        cfg = load_config(tmp, world_size=1)
        os.replace(tmp, out)  # an earlier file at --out is replaced only by a config that loads
    except ConfigError as e:
        raise ConfigError(f"the matched config does not load: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    print_shapes(config, out, src_cfg, cfg, match, pieces)


def print_shapes(config: str, out: Path, src_cfg, cfg, match: dict, pieces: int) -> None:
    """The source and the written shape side by side (a markdown table), and a warning when the written
    one is more than 10% off the source's training FLOPs per byte."""
    m = cfg.model
    bpe_fpb = flops.flops_per_byte(cfg)["training"]
    ratio = bpe_fpb / match["target_flops_per_byte"]
    rows = [("", "unet (source)", "bpe (written)"),
            ("config", config, str(out)),
            ("shape", f"d {src_cfg.model.d_model}, main {src_cfg.model.main_width} x {src_cfg.model.n_main_layers}",
             f"{m.main_width} x {m.n_main_layers} ({m.main_heads} heads), vocab {m.vocab_size}"),
            ("seq_len", f"{src_cfg.data.seq_len} bytes",
             f"{cfg.data.seq_len} tokens x {m.bytes_per_token:g} bytes/token"),
            ("params", f"{match['target_params']:,}", f"{flops.param_counts(cfg)['total']:,}"),
            ("training FLOPs/byte", f"{match['target_flops_per_byte']:.4g}", f"{bpe_fpb:.4g}"),
            ("ratio bpe / unet", "", f"{ratio:.4f}")]
    if abs(ratio - 1) > 0.10:
        print(f"warning: the closest shape is {ratio:.3f} x the unet's FLOPs per byte (no width in "
              f"[dm/2, 2 dm] and depth up to 4 n_main + 4 gets within 10%)", file=sys.stderr)
    print(f"match_bpe: {pieces} pieces -> vocab_size {m.vocab_size}; wrote {out}")
    print("| " + " | ".join(rows[0]) + " |\n|---|---:|---:|")
    for r in rows[1:]:
        print("| " + " | ".join(r) + " |")
