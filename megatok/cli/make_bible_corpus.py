"""megatok-make-bible-corpus: the command line of megatok.data.bible (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys
from megatok.data import bible
from megatok.data.bible import TRANSLATIONS, CorpusError
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=bible.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="training documents (.jsonl or .jsonl.gz)")
    ap.add_argument("--heldout-out", default=None, help="parallel held-out chapters (.jsonl or .jsonl.gz)")
    ap.add_argument("--langs", default=",".join(TRANSLATIONS), help=f"comma-separated, from {','.join(TRANSLATIONS)}")
    ap.add_argument("--max-mb-per-lang", type=float, default=2.0, help="training text per language (0: all, ~4 MB)")
    ap.add_argument("--heldout-every", type=int, default=50, help="hold out every N-th chapter of the canon")
    ap.add_argument("--cache", default="data/.cache", help="where the package is downloaded and unpacked")
    ap.add_argument("--offline", action="store_true", help="never download; use the cache only")
    args = ap.parse_args(argv)
    langs = [x.strip() for x in args.langs.split(",") if x.strip()]
    bad = [x for x in langs if x not in TRANSLATIONS]
    if bad or not langs:
        print(f"error: --langs: unknown language {bad[0] if bad else '(none)'} (available: "
              f"{', '.join(TRANSLATIONS)})", file=sys.stderr)
        return 2
    if args.heldout_every < 0:
        print("error: --heldout-every must be >= 0", file=sys.stderr)
        return 2
    try:
        bible.make(args.out, args.heldout_out, langs, args.max_mb_per_lang, args.heldout_every, args.cache,
                   args.offline)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
