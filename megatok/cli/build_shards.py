"""Build WebDataset train/val shards from text, JSON-lines, parquet and Arrow files.

    megatok-build-shards data/raw/ extra.jsonl.gz --out data/shards --val-fraction 0.01
    megatok-build-shards fineweb/data/CC-MAIN-2024-10/ --out data/fineweb --lang-field language
    megatok-build-shards dolma/*.json.zst --out data/dolma --domain-field source --workers 16

Formats (docs/data.md): .txt(.gz/.zst), .jsonl(.gz/.zst) and .json.gz/.json.zst JSON lines, .parquet
(FineWeb, the Hugging Face hub cache), .arrow (datasets.save_to_disk directories, the datasets cache),
and directories of them. See megatok/data/shards.py for the output. Exits 2 with a one-line
"error: ..." on bad input.
"""

import argparse
import sys
import time

from megatok.data.documents import DataError, Fields
from megatok.data.shards import build_shards, usable_cpus
from megatok.cli import command_parser


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="files (.txt, .jsonl, .json.gz/.zst, .parquet, .arrow; .gz/.zst) or directories of them")
    parser.add_argument("--out", required=True, help="output shard directory")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--num-shards", type=int, default=None, help="train shards (default: from input size)")
    parser.add_argument("--val-shards", type=int, default=None)
    parser.add_argument("--shard-mb", type=float, default=64, help="target shard size when --num-shards is not given")
    parser.add_argument("--max-doc-mb", type=float, default=1, help="longer documents are split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lang", default=None, help="language of .txt inputs (and records without one)")
    parser.add_argument("--domain", default=None, help="domain of .txt inputs (and records without one)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help='the JSON key or column of the text (default "text"; dotted for a nested one)')
    parser.add_argument("--lang-field", default="lang", metavar="NAME",
                        help='the key or column read as the document\'s lang (default "lang"; FineWeb: language, '
                             'RedPajama: meta.language)')
    parser.add_argument("--domain-field", default="domain", metavar="NAME",
                        help='the key or column read as the document\'s domain (default "domain"; Dolma: source)')
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="processes that read the inputs and write the shards (default: the CPUs this "
                             "process may use); the shards are the same for any number")
    parser.add_argument("--lang-weight", nargs="+", default=[], metavar="LANG=W",
                        help="mixture weights of the train split by document lang: 3 triples a language, 0.5 keeps "
                             "about half, 0 drops it (default 1; the val split keeps the natural mix)")
    parser.add_argument("--domain-weight", nargs="+", default=[], metavar="DOMAIN=W",
                        help="the same by document domain (multiplies the lang weight)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    workers = args.workers if args.workers is not None else usable_cpus()
    if workers < 1:
        parser.error(f"--workers must be at least 1, got {workers}")
    start = time.monotonic()
    try:
        lang_weights = parse_weights(args.lang_weight, "--lang-weight")
        domain_weights = parse_weights(args.domain_weight, "--domain-weight")
        m = build_shards(args.inputs, args.out, val_fraction=args.val_fraction, num_shards=args.num_shards,
                         val_shards=args.val_shards, shard_bytes=int(args.shard_mb * 2**20), seed=args.seed,
                         overwrite=args.overwrite, lang=args.lang, domain=args.domain,
                         max_doc_bytes=int(args.max_doc_mb * 2**20), progress=not args.no_progress,
                         lang_weights=lang_weights, domain_weights=domain_weights,
                         fields=Fields(args.text_field, args.lang_field, args.domain_field), workers=workers)
    except (DataError, ValueError) as exn:
        print("error: " + " ".join(str(exn).split()), file=sys.stderr)
        return 2
    except OSError as exn:  # a full disk, a quota, an output that cannot be made: the old output is not removed
        print(f"error: {exn.filename or args.out}: {exn.strerror or exn}", file=sys.stderr)
        return 2
    docs, nbytes, seconds = m["documents"], m["bytes"], time.monotonic() - start
    total = nbytes["train"] + nbytes["val"]
    print(f"wrote {args.out}: {docs['train'] + docs['val']} documents (train {docs['train']}, val {docs['val']}), "
          f"{total / 2**20:.1f} MiB; {len(m['train'])} train + {len(m['val'])} val shards; "
          f"{m['empty_documents_skipped']} empty documents skipped, {m['split_documents']} long documents split; "
          f"{seconds:.1f} s, {m['input_bytes'] / 1e6 / seconds:.1f} MB/s of input with {workers} worker(s)")
    if lang_weights or domain_weights:
        total = sum(m["bytes_by_lang"]["train"].values())
        print("train bytes by lang after the weights: " + ", ".join(
            f"{k if k != 'None' else '(no lang)'} {100 * v / total:.1f}%" for k, v in m["bytes_by_lang"]["train"].items()))
    return 0


def parse_weights(items: list[str], flag: str) -> dict[str, float]:
    """--lang-weight / --domain-weight (``flag``): NAME=WEIGHT items -> {NAME: WEIGHT}; ValueError naming the item."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"{flag} {item}: expected NAME=WEIGHT, e.g. ru=3") from None
        if not sep or not name:
            raise ValueError(f"{flag} {item}: expected NAME=WEIGHT, e.g. ru=3")
    return out


if __name__ == "__main__":
    sys.exit(main())
