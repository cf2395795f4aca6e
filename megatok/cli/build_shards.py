"""Build WebDataset train/val shards from text and JSON-lines files.

    megatok-build-shards data/raw/ extra.jsonl.gz --out data/shards --val-fraction 0.01

See megatok/data/shards.py for the format. Exits 2 with a one-line "error: ..." on bad input.
"""

import argparse
import sys

from megatok.data.documents import DataError
from megatok.data.shards import build_shards


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl (optionally .gz) files or directories")
    parser.add_argument("--out", required=True, help="output shard directory")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--num-shards", type=int, default=None, help="train shards (default: from input size)")
    parser.add_argument("--val-shards", type=int, default=None)
    parser.add_argument("--shard-mb", type=float, default=64, help="target shard size when --num-shards is not given")
    parser.add_argument("--max-doc-mb", type=float, default=1, help="longer documents are split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lang", default=None, help="language of .txt inputs (and JSON lines without one)")
    parser.add_argument("--domain", default=None, help="domain of .txt inputs (and JSON lines without one)")
    parser.add_argument("--lang-weight", nargs="+", default=[], metavar="LANG=W",
                        help="mixture weights of the train split by document lang: 3 triples a language, 0.5 keeps "
                             "about half, 0 drops it (default 1; the val split keeps the natural mix)")
    parser.add_argument("--domain-weight", nargs="+", default=[], metavar="DOMAIN=W",
                        help="the same by document domain (multiplies the lang weight)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        lang_weights, domain_weights = _weights(args.lang_weight, "--lang-weight"), _weights(args.domain_weight,
                                                                                             "--domain-weight")
        m = build_shards(args.inputs, args.out, val_fraction=args.val_fraction, num_shards=args.num_shards,
                         val_shards=args.val_shards, shard_bytes=int(args.shard_mb * 2**20), seed=args.seed,
                         overwrite=args.overwrite, lang=args.lang, domain=args.domain,
                         max_doc_bytes=int(args.max_doc_mb * 2**20), progress=not args.no_progress,
                         lang_weights=lang_weights, domain_weights=domain_weights)
    except (DataError, ValueError) as exn:
        print("error: " + " ".join(str(exn).split()), file=sys.stderr)
        return 2
    except OSError as exn:  # a full disk, a quota, an output that cannot be made: the old output is not removed
        print(f"error: {exn.filename or args.out}: {exn.strerror or exn}", file=sys.stderr)
        return 2
    docs, nbytes = m["documents"], m["bytes"]
    print(f"wrote {args.out}: {docs['train'] + docs['val']} documents (train {docs['train']}, val {docs['val']}), "
          f"{(nbytes['train'] + nbytes['val']) / 2**20:.1f} MiB; {len(m['train'])} train + {len(m['val'])} val shards; "
          f"{m['empty_documents_skipped']} empty documents skipped, {m['split_documents']} long documents split")
    if lang_weights or domain_weights:
        total = sum(m["bytes_by_lang"]["train"].values())
        print("train bytes by lang after the weights: " + ", ".join(
            f"{k if k != 'None' else '(no lang)'} {100 * v / total:.1f}%" for k, v in m["bytes_by_lang"]["train"].items()))
    return 0


def _weights(items: list[str], flag: str) -> dict[str, float]:
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
