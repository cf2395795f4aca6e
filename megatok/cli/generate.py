"""Sample text from a run's checkpoint (or an export): megatok's byte model or the BPE token model.

    megatok-generate --run runs/tiny --prompt "def main(" --max-bytes 300
    megatok-generate --run runs/tiny --prompt "The " --num 3 --temperature 0.8 --top-k 40 --chunks
    megatok-generate --run runs/tiny --checkpoint step00000200 --prompt "The " --top-p 0.9
    megatok-generate --run runs/h2h/bpe --prompt-file prompt.txt --json
    megatok-generate --run exports/tiny --prompt "The "             # a megatok-export directory

Each sample continues the prompt (read as a new document) until --max-bytes bytes or the model's
document separator, one byte (or token) per step of the model over its cached keys and values (the --num
samples together, as one batch), on a GPU where the machine has one (--device); there, --cuda-graph replays
that step as one CUDA graph; --compile runs it through torch.compile (CPU or GPU; it compiles first).
--temperature 0 is greedy; --top-k and --top-p (nucleus) restrict the sampled ids as the Python API's
generate(top_k=, top_p=) does (--top-k 0: no limit). Sample i uses seed
--seed + i (ids and, for the byte model, boundaries: sampled as in validation, or p > 0.5 with
--boundary threshold).
--chunks marks where the byte model's chunks start ("│"; "¦" inside a UTF-8 character). Each sample
is followed by its length, whether it stopped at a separator, and the model's bits per byte on its
own sample. Method: megatok/generate.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatok import sizing
from megatok.cli import add_device, command_parser, device_or_default


def build_parser() -> argparse.ArgumentParser:
    ap = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory (its latest checkpoint, or --checkpoint) or an "
                                                 "export (megatok-export)")
    ap.add_argument("--checkpoint", "--tag", dest="checkpoint", default=None,
                    help="checkpoint tag, e.g. step00000200 (default: latest)")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue, its bytes as given (default: none, a new document)")
    prompt.add_argument("--prompt-file", default=None, help="read the prompt's bytes from a file")
    ap.add_argument("--max-bytes", type=sizing.positive(int), default=200,
                    help="bytes to generate per sample (default 200; a BPE model's last token may run past it)")
    ap.add_argument("--num", type=sizing.positive(int), default=1, help="samples (default 1)")
    ap.add_argument("--temperature", type=sizing.non_negative(float, " (0: greedy)"), default=1.0,
                    help="0: greedy (default 1)")
    ap.add_argument("--top-k", type=sizing.non_negative(int, " (0: no limit)"), default=None,
                    help="sample among the k most likely ids (default, or 0: no limit)")
    ap.add_argument("--top-p", type=sizing.positive(float, most=1), default=None,
                    help="sample among the most likely ids whose probabilities reach p together (default: all ids)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--boundary", choices=("sample", "threshold"), default="sample",
                    help="byte model: boundaries sampled (seeded) or p > 0.5")
    ap.add_argument("--chunks", action="store_true", help="byte model: mark chunk starts")
    ap.add_argument("--sep", default="│", help="with --chunks: the mark before each chunk")
    add_device(ap)
    ap.add_argument("--no-cache", dest="cache", action="store_false",
                    help="rerun the model over the whole window at every id (slower; a window sliding by one id)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="(a GPU, --device cuda) capture the step once as a CUDA graph and replay it: one launch a "
                         "step instead of one a kernel; the samples stay in the batch to the end")
    ap.add_argument("--compile", action="store_true",
                    help="run the step through torch.compile (compiles first, seconds to a minute; faster after on "
                         "a CPU at small batches: docs/results/2026-12-inference.md)")
    ap.add_argument("--json", action="store_true", help="one JSON object per sample instead of text")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.device = device_or_default(args.device)
    for flag in ("cuda_graph", "compile"):
        if getattr(args, flag) and not args.cache:
            ap.error(f"--{flag.replace('_', '-')} runs the cached step: not with --no-cache")
    if args.cuda_graph and args.compile:
        ap.error("--cuda-graph and --compile are two ways to run the step: choose one")
    if args.cuda_graph and not args.device.startswith("cuda"):
        print(f"error: --cuda-graph needs a CUDA device (--device cuda), not {args.device}", file=sys.stderr)
        return 2

    from tqdm import tqdm

    from megatok import display
    from megatok.config import ConfigError
    from megatok.data.encoding import encoding_for
    from megatok.generate import generate_batch
    from megatok.run.export import load_model_or_export

    sizing.quiet_deepspeed_import()  # stdout carries only the samples (--json stays parseable)
    try:
        data = Path(args.prompt_file).read_bytes() if args.prompt_file else os.fsencode(args.prompt)
        model, cfg, tag = load_model_or_export(args.run, args.checkpoint, device=args.device)
        encoding = encoding_for(cfg)
    except (FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    byte_model = cfg.model.kind != "bpe"
    if args.chunks and not byte_model:
        print("error: --chunks needs a byte model; this run is a BPE token model", file=sys.stderr)
        return 2
    if byte_model and args.boundary == "sample" and model.boundary.reads_earlier_decisions:
        args.boundary = "threshold"
        print("note: boundary.window > 1: boundaries are p > 0.5 (--boundary threshold)", file=sys.stderr)
    print(f"# {args.run} ({cfg.model.kind}{', ' + cfg.boundary.strategy if byte_model else ''}, {tag or 'export'}), "
          f"temperature {args.temperature:g}{f', top-k {args.top_k}' if args.top_k else ''}"
          f"{f', top-p {args.top_p:g}' if args.top_p is not None else ''}", file=sys.stderr)
    with tqdm(total=args.max_bytes * args.num, unit="B", desc=f"{args.num} sample(s)", leave=False,
              disable=None) as bar:
        gens = generate_batch(model, [data] * args.num, seq_len=cfg.data.seq_len, max_bytes=args.max_bytes,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seeds=[args.seed + i for i in range(args.num)], boundary_mode=args.boundary,
                              encoding=encoding, progress=bar, cache=args.cache, cuda_graph=args.cuda_graph,
                              compile=args.compile)
    for i, g in enumerate(gens):
        print(display.sample(g, data, i, args.seed + i, as_json=args.json, chunks=args.chunks, sep=args.sep,
                             byte_model=byte_model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
