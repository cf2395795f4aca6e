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

import argparse
import json
import os
import sys
from pathlib import Path

from megatok import flops, sizing
from megatok.bpe import tokenizer_facts
from megatok.config import ConfigError, find_config, load_config, merge, overrides_dict


def build(args) -> tuple[dict, dict, object, object]:
    """(the output config dict, match_bpe's result, source config, written config)."""
    src = find_config(args.config)
    if not src.is_file():
        raise ConfigError(f"--config {src}: file not found")
    cfg = load_config(src, args.overrides, world_size=1)
    if args.tokenizer:
        model_path, pieces, bpt = tokenizer_facts(args.tokenizer)
        if args.bytes_per_token is not None:
            bpt = args.bytes_per_token
        if bpt is None:
            raise ConfigError(f"--tokenizer {args.tokenizer}: no report.json with bytes per token next to it; "
                              "give --bytes-per-token")
    else:
        if args.vocab_size is None or args.bytes_per_token is None:
            raise ConfigError("give --tokenizer DIR, or --vocab-size and --bytes-per-token")
        model_path, pieces, bpt = args.tokenizer_path, args.vocab_size, args.bytes_per_token
    if pieces <= 0 or bpt <= 0:
        raise ConfigError(f"vocabulary size and bytes per token must be positive (got {pieces}, {bpt})")
    match = flops.match_bpe(cfg, tokenizer=model_path, vocab_size=pieces, bytes_per_token=bpt, rate=args.rate)
    out = Path(args.out)
    rel = os.path.relpath(src.resolve(), out.parent.resolve())
    raw = merge(overrides_dict(args.overrides), match["overrides"])
    raw = merge(raw, {"train": {"run_dir": args.run_dir or cfg.train.run_dir + "-bpe"}})
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the megatok (unet) config to match")
    tok = ap.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="megatok-train-bpe output directory or its tokenizer.model")
    tok.add_argument("--vocab-size", type=int, help="tokenizer pieces (without --tokenizer)")
    ap.add_argument("--bytes-per-token", type=float, help="expected bytes per token of the training data")
    ap.add_argument("--tokenizer-path", default="data/bpe/tokenizer.model",
                    help="model.tokenizer to write with --vocab-size (default data/bpe/tokenizer.model)")
    ap.add_argument("--rate", type=float, default=None, help="chunks per byte of the unet (default its target_rate)")
    ap.add_argument("--out", required=True, help="config file to write")
    ap.add_argument("--run-dir", default=None, help="train.run_dir of the BPE run (default: the source's + '-bpe')")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    if args.tokenizer and args.tokenizer_path != ap.get_default("tokenizer_path"):
        print("error: --tokenizer-path is for --vocab-size; --tokenizer already names the model", file=sys.stderr)
        return 2
    sizing.quiet_deepspeed_import()
    out = Path(args.out)
    try:
        written, match, src_cfg, pieces = build(args)
        if out.resolve() in extends_chain(find_config(args.config)):
            raise ConfigError(f"--out {out}: that is {args.config} or a config it extends, which the matched "
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
    except (ConfigError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    m = cfg.model
    bpe_fpb = flops.flops_per_byte(cfg)["training"]
    ratio = bpe_fpb / match["target_flops_per_byte"]
    rows = [("", "unet (source)", "bpe (written)"),
            ("config", args.config, str(out)),
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
