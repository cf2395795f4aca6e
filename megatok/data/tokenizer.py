"""Train the sentencepiece BPE tokenizer megatok is compared against, and report its bytes per token.

    megatok-train-bpe --data data/corpus.jsonl.gz --vocab-size 4096 --out runs/bpe4k \\
        [--heldout data/heldout_udhr.jsonl] [--max-mb 64]
    megatok-train-bpe --data data/shards --vocab-size 4096 --out runs/bpe4k

--data takes what build_shards reads (.txt, .txt.gz, .jsonl, .jsonl.gz, directories of them) or a
build_shards output directory, whose train split is used. The model is byte-level BPE with byte
fallback and identity normalisation, so ANY bytes (invalid UTF-8 included) round-trip exactly through
megatok.bpe.encode_bytes / decode_ids (the contract is in megatok/bpe.py).

Writes OUT/tokenizer.model and OUT/report.json: vocabulary size, the sentencepiece options, and bytes
per token (overall and per "lang" and "domain") on the training text (the documents fed, up to
--max-mb) and on held-out text: the validation split of every shard directory in --data, and each
--heldout file (e.g. the parallel UDHR set from megatok-make-corpus --heldout-out), with the
disparity across languages (max / min bytes per token), and "encode_speed": how fast the training
data pipeline tokenises (one dataloader worker). Exit status 2 on bad input, one error line.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from megatok import bpe
from megatok.data.documents import DataError, iter_documents, list_input_files
from megatok.data.inputs import is_shards, read_documents

MB = 1_000_000


def _limit(docs, max_bytes: int | None):
    """Documents until (and including) the one that brings the total to max_bytes: what train_bpe fed."""
    seen = 0
    for d in docs:
        if max_bytes is not None and seen >= max_bytes:
            return
        seen += len(d.text)
        yield d


def measure(sp, docs, desc: str, total: int | None = None) -> dict:
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=None)
    try:
        r = bpe.bytes_per_token(sp, docs, progress=bar)
    finally:
        bar.close()
    if len(r.get("by_lang", {})) >= 2:  # max/min across languages
        r["lang_disparity"] = bpe.disparity({k: v["bytes_per_token"] for k, v in r["by_lang"].items()})
    return r


def pipeline_speed(model: str, docs, max_bytes: int = 4 * MB) -> dict:
    """How fast the training data pipeline tokenises (megatok.data.encoding, one document at a time, as one
    dataloader worker does), on the first max_bytes of docs."""
    from megatok.data.encoding import BpeEncoding

    enc = BpeEncoding(model)
    n_bytes = n_tokens = 0
    t = time.perf_counter()
    for d in docs:
        n_tokens += len(enc.doc_ids(d.text))
        n_bytes += len(d.text)
        if n_bytes >= max_bytes:
            break
    dt = max(time.perf_counter() - t, 1e-9)
    return {"bytes": n_bytes, "tokens": n_tokens, "seconds": round(dt, 3), "mb_per_s": n_bytes / dt / MB,
            "tokens_per_s": n_tokens / dt}


def train_and_measure(data: list[str], vocab_size: int, out: Path, *, max_mb: float | None = None,
                      heldout: list[str] = (), character_coverage: float = bpe.SP_OPTIONS["character_coverage"],
                      overwrite: bool = False) -> tuple[dict, dict, float]:
    """(train_bpe's result, report.json's content, training seconds): the tokenizer trained on ``data`` into
    ``out`` and measured on its training text, the val split of a shard directory and the ``heldout`` files.
    Every input is checked first, before anything is trained."""
    max_bytes = int(max_mb * MB) if max_mb else None
    t0 = time.perf_counter()
    trained_on = list_input_files([p for p in data if not is_shards(p)])
    heldout_files = list_input_files(list(heldout)) if heldout else []
    also = sorted({os.path.realpath(f) for f in trained_on} & {os.path.realpath(f) for f in heldout_files})
    if also:  # its bytes per token would be measured on training text
        print(f"warning: --heldout {', '.join(also[:3])} is also in --data: trained on, so not held out",
              file=sys.stderr)
    for f in heldout:  # a malformed held-out file fails now, not after training
        for _ in iter_documents([f]):
            pass
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    if out.suffix == ".model":  # a directory is written: tokenizer.model and report.json
        raise DataError(f"--out {out}: give the output directory (it gets tokenizer.model and report.json)")
    if (out / "tokenizer.model").exists() and not overwrite:
        raise DataError(f"{out / 'tokenizer.model'}: exists, and runs trained with it need it as it is (they "
                        f"record its digest and refuse another); --overwrite replaces it")
    trained = bpe.train_bpe(read_documents(data, "train"), out, vocab_size, max_bytes=max_bytes,
                            progress=True, character_coverage=character_coverage)
    t_train = time.perf_counter() - t0
    sp = bpe.load_tokenizer(trained["model"])
    report = {"model": "tokenizer.model", "vocab_size": trained["vocab_size"],
              "requested_vocab_size": vocab_size, "inputs": data, "max_mb": max_mb,
              "options": trained["options"], "train_seconds": round(t_train, 1)}
    report["train"] = measure(sp, _limit(read_documents(data, "train"), max_bytes), "measure train",
                              trained["bytes"])
    measured = {}
    val_dirs = [p for p in data if is_shards(p) and os.path.isdir(p)]  # only a shard directory has a val split
    if val_dirs:
        measured["val"] = measure(sp, read_documents(val_dirs, "val"), "measure val")
    for f in heldout:
        measured[f] = measure(sp, iter_documents([f]), f"measure {Path(f).name}")
    report["heldout"] = measured
    report["encode_speed"] = pipeline_speed(trained["model"], read_documents(data, "train"))
    return trained, report, t_train


def train(data: list[str], vocab_size: int, out: str, *, max_mb: float | None = None, heldout: list[str] = (),
          character_coverage: float = bpe.SP_OPTIONS["character_coverage"], overwrite: bool = False) -> None:
    """What megatok-train-bpe does: the tokenizer trained on ``data`` into OUT/tokenizer.model, measured into
    OUT/report.json, and what it measured printed. DataError, ValueError or FileNotFoundError (one line)
    on bad input, before anything is trained."""
    out = Path(out)
    trained, report, t_train = train_and_measure(data, vocab_size, out, max_mb=max_mb, heldout=heldout,
                                                 character_coverage=character_coverage, overwrite=overwrite)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    if trained["vocab_size"] < vocab_size:
        print(f"warning: the text supports only {trained['vocab_size']} pieces, not {vocab_size}",
              file=sys.stderr)
    print(f"wrote {trained['model']} ({trained['vocab_size']} pieces, trained on {trained['documents']:,} documents, "
          f"{trained['bytes']:,} bytes in {t_train:.1f}s) and {out / 'report.json'}")
    speed = report["encode_speed"]
    print(f"data pipeline: {speed['mb_per_s']:.1f} MB/s, {speed['tokens_per_s'] / 1e6:.2f} M tokens/s per dataloader "
          f"worker (megatok.data.encoding on {speed['bytes']:,} bytes)")
    for name, r in itertools.chain([("train", report["train"])], report["heldout"].items()):
        print(f"{name}: {r['bytes_per_token']:.3f} bytes/token over {r['bytes']:,} bytes")
        for lang, v in r.get("by_lang", {}).items():
            print(f"  {lang:<8} {v['bytes_per_token']:.3f}")
        if "lang_disparity" in r:
            print(f"  disparity (max/min bytes per token) {r['lang_disparity']:.2f}")
