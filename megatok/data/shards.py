"""Writing documents into WebDataset tar shards, with a manifest.

One sample per document: key "%010d" % document index, "bin" = the raw bytes, "json" = {"lang",
"domain", "source"}. The build runs in two passes so every shard is a random mix of all sources in
a random order (otherwise a reader would see one language, then the next, for a whole shard):

1. read the inputs once, appending each document to a spill file in the temporary directory and
   keeping only (offset, lengths) in memory;
2. choose the val documents, shuffle the rest and cut them into shards of equal document counts,
   then copy each shard's documents out of the spill file into a tar.

Everything is written into "<out_dir>.tmp-<pid>" and renamed into place at the end, so a failed
or interrupted build never leaves a half-written shard directory or damages an existing one.
"""

import hashlib
import json
import math
import os
import shutil
from array import array
from datetime import datetime, timezone

import numpy as np
import webdataset as wds
from tqdm import tqdm

from megatok.data.documents import DataError, iter_documents, list_input_files

MANIFEST = "manifest.json"
FORMAT = "megatok-shards"
VERSION = 1


def _val_score(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, document index): the val decision."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _estimate_bytes(files: list[str]) -> int:
    """Input size from the sizes on disk; gzip is assumed to compress text about 3x."""
    return sum(os.path.getsize(f) * (3 if f.endswith(".gz") else 1) for f in files)


def _choose_val(scores: np.ndarray, first: np.ndarray, val_fraction: float) -> np.ndarray:
    """Boolean val mask over the documents (pieces of split ones; ``first``: each one's first piece,
    ``scores``: its document's score). A whole document is val when its score < val_fraction. One split
    into k pieces holds out its last floor(val_fraction x k + score) pieces: a contiguous tail (as
    enwik8 holds out its end), so no val piece sits between training pieces of its document, and the
    fraction holds by pieces even for a corpus of one large file. At least one val and one train piece
    when n >= 2."""
    n = len(scores)
    k = np.bincount(first, minlength=n)[first]  # the pieces of each one's document
    held = np.where(k == 1, scores < val_fraction, np.floor(val_fraction * k + scores)).astype(np.int64)
    is_val = np.arange(n) - first >= k - held
    if val_fraction > 0 and n >= 2 and not is_val.any():
        d = int(np.argmin(scores))  # the lowest-scored document's first piece; its last piece goes to val
        is_val[d + k[d] - 1] = True
    if is_val.all():  # never leave train empty; with n >= 2 at least one val piece remains
        is_val[np.argmax(scores)] = False  # the highest-scored document's first piece
    return is_val


def _bytes_by(labels: list, lens: np.ndarray, indices) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in indices:
        key = str(labels[i])  # "None" for documents without one
        out[key] = out.get(key, 0) + int(lens[i])
    return dict(sorted(out.items()))


def _copies(weights: np.ndarray, seed: int, first: np.ndarray) -> np.ndarray:
    """Copies of each document for mixture weights: floor(w), plus one more with probability w - floor(w)
    (decided by (seed, index of the input document's first piece) alone, like the val split)."""
    base = np.floor(weights)
    extra = np.array([_val_score(seed + 7919, int(i)) for i in first]) < weights - base
    return (base + extra).astype(np.int64)


def _write_shard(path: str, indices, spill, offsets, text_lens, meta_lens, bar, copies=None) -> dict:
    """Copy the given documents out of the spill file into one tar; return its manifest entry. A document's
    repeat c > 0 (mixture weights) gets the key "<index>_<c>"."""
    n_bytes = 0
    with open(path, "wb") as f, wds.TarWriter(f, encoder=False, mtime=0) as writer:  # mtime=0: reproducible tars
        for k, i in enumerate(indices):
            spill.seek(offsets[i])
            text = spill.read(text_lens[i])
            meta = spill.read(meta_lens[i])
            c = copies[k] if copies is not None else 0
            writer.write({"__key__": "%010d" % i + (f"_{c}" if c else ""), "bin": text, "json": meta})
            n_bytes += len(text)
            bar.update(len(text))
    return {"name": os.path.basename(path), "documents": len(indices), "bytes": n_bytes,
            "file_bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _build(inputs, files, tmp, *, val_fraction, num_shards, shard_bytes, min_shards, val_shards,
           seed, lang, domain, max_doc_bytes, progress, weights) -> dict:
    """Both passes of the build, writing into the (existing, empty) directory tmp."""
    estimate = _estimate_bytes(files)
    stats = {}
    offsets, text_lens, meta_lens, first = array("q"), array("q"), array("q"), array("q")
    doc_weights, doc_langs, seen = array("d"), [], {"lang": set(), "domain": set()}
    spill_path = os.path.join(tmp, "documents.spill")
    with open(spill_path, "w+b") as spill:
        # pass 1: read every input once
        with tqdm(total=estimate, unit="B", unit_scale=True, desc="reading", disable=not progress) as bar:
            docs = iter_documents(inputs, lang=lang, domain=domain, max_doc_bytes=max_doc_bytes, stats=stats)
            for i, doc in enumerate(docs):
                meta = json.dumps({"lang": doc.lang, "domain": doc.domain, "source": doc.source}).encode()
                offsets.append(spill.tell())
                text_lens.append(len(doc.text))
                meta_lens.append(len(meta))
                first.append(i - doc.piece)  # the pieces of a split document share its first piece's draws
                seen["lang"].add(doc.lang)
                doc_langs.append(doc.lang)
                seen["domain"].add(doc.domain)
                doc_weights.append(weights["lang"].get(doc.lang, 1.0) * weights["domain"].get(doc.domain, 1.0))
                spill.write(doc.text)
                spill.write(meta)
                bar.update(len(doc.text))
        n = len(offsets)
        if n == 0:
            raise DataError(f"no documents in {', '.join(inputs)} "
                            f"({stats.get('empty_documents', 0)} empty documents skipped)")

        for key, table in weights.items():
            for value in table:
                if value not in seen[key]:
                    raise DataError(f"{key} weight {value}={table[value]:g}: no document has {key} {value!r} "
                                    f"(found: {', '.join(sorted(map(str, seen[key] - {None}))) or 'none'})")

        # pass 2: split, shuffle (train: with each document's copies for the mixture weights), cut, write
        # decided per input document (see _choose_val: a split one holds out a tail of its pieces); the
        # same decisions as before when nothing was split
        first_piece = np.frombuffer(first, dtype=np.int64)
        is_val = _choose_val(np.array([_val_score(seed, int(i)) for i in first_piece]), first_piece, val_fraction)
        lens = np.frombuffer(text_lens, dtype=np.int64)
        n_copies = _copies(np.frombuffer(doc_weights, dtype=np.float64), seed, first_piece) if any(weights.values()) else None
        rng = np.random.default_rng(seed)
        splits, repeat = {}, {}
        for split, mask in (("train", ~is_val), ("val", is_val)):
            docs = np.flatnonzero(mask)
            nth = np.zeros(len(docs), dtype=np.int64)  # which copy of its document each entry is
            order = rng.permutation(len(docs))  # drawn as without weights, so the val split is unchanged
            if split == "train" and n_copies is not None:
                counts = n_copies[docs]
                docs = np.repeat(docs, counts)
                nth = np.arange(len(docs)) - np.repeat(np.cumsum(counts) - counts, counts)
                if not len(docs):
                    raise DataError("the mixture weights leave no training document")
                order = np.random.default_rng([seed, 1]).permutation(len(docs))
            idx, nth = docs[order], nth[order]
            if split == "train":
                wanted = num_shards or max(min_shards, math.ceil(estimate / shard_bytes))
            else:
                wanted = val_shards or max(1, min(4, math.ceil(lens[idx].sum() / shard_bytes)))
            n_parts = min(wanted, len(idx))
            splits[split] = np.array_split(idx, n_parts) if len(idx) else []
            repeat[split] = np.array_split(nth, n_parts) if len(idx) else []
        manifest = {
            "format": FORMAT, "version": VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": list(inputs), "seed": seed, "val_fraction": val_fraction, "max_doc_bytes": max_doc_bytes,
            "documents": {s: int(sum(len(c) for c in chunks)) for s, chunks in splits.items()},
            "bytes": {s: int(sum(lens[c].sum() for c in chunks)) for s, chunks in splits.items()},
            "empty_documents_skipped": stats["empty_documents"],
            "split_documents": stats["split_documents"],
            "weights": weights,
            "bytes_by_lang": {s: _bytes_by(doc_langs, lens, np.concatenate(c) if len(c) else c)
                              for s, c in splits.items()},
        }
        with tqdm(total=int(lens.sum()), unit="B", unit_scale=True, desc="writing", disable=not progress) as bar:
            for split, chunks in splits.items():
                manifest[split] = [
                    _write_shard(os.path.join(tmp, f"{split}-{k:05d}.tar"), chunk.tolist(), spill,
                                 offsets, text_lens, meta_lens, bar, repeat[split][k].tolist())
                    for k, chunk in enumerate(chunks)]
    os.remove(spill_path)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def _replace_dir(tmp: str, out_dir: str) -> None:
    """Move tmp to out_dir; an existing out_dir is removed only once the new one is in place."""
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
        return
    old = f"{out_dir}.old-{os.getpid()}"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old)


def build_shards(inputs: list[str], out_dir: str, *, val_fraction: float = 0.01, num_shards: int | None = None,
                 shard_bytes: int = 64 << 20, min_shards: int = 8, val_shards: int | None = None, seed: int = 0,
                 overwrite: bool = False, lang: str | None = None, domain: str | None = None,
                 max_doc_bytes: int = 1 << 20, progress: bool = True, lang_weights: dict[str, float] | None = None,
                 domain_weights: dict[str, float] | None = None) -> dict:
    """Build train/val WebDataset shards and manifest.json from the inputs; return the manifest.

    num_shards defaults to max(min_shards, input bytes / shard_bytes) so that there are enough
    shards for every (rank, dataloader worker) reader; val_shards to between 1 and 4. Either is
    reduced to the number of documents so that no shard is empty.

    Mixture weights: a training document whose lang has weight w (times its domain's weight; 1 when
    not listed) appears floor(w) times, plus once more with probability w - floor(w), seeded per
    document: 3 triples a language, 0.5 keeps about half of it, 0 drops it. The val split keeps the
    natural mix, so validation figures stay comparable across mixtures. The manifest records the
    weights and the resulting bytes per language of each split.
    """
    weights = {"lang": dict(lang_weights or {}), "domain": dict(domain_weights or {})}
    for key, table in weights.items():
        for name, w in table.items():
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ValueError(f"{key} weight {name}={w}: must be a finite number >= 0")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    for name, value in (("num_shards", num_shards), ("val_shards", val_shards)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if shard_bytes < 1 or min_shards < 1:
        raise ValueError("shard_bytes and min_shards must be positive")
    files = list_input_files(inputs)  # fail on a missing input before touching anything
    out_dir = os.path.normpath(out_dir)
    if os.path.islink(out_dir):  # e.g. data/shards -> /shared/shards: rebuild the target, keep the link
        out_dir = os.path.realpath(out_dir)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise DataError(f"{out_dir}: exists and is not a directory")
        if os.listdir(out_dir) and not overwrite:
            raise DataError(f"{out_dir}: directory exists and is not empty (use --overwrite to replace it)")
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        manifest = _build(inputs, files, tmp, val_fraction=val_fraction, num_shards=num_shards,
                          shard_bytes=shard_bytes, min_shards=min_shards, val_shards=val_shards, seed=seed,
                          lang=lang, domain=domain, max_doc_bytes=max_doc_bytes, progress=progress, weights=weights)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def read_manifest(shard_dir: str) -> dict:
    """Load and check manifest.json of a shard directory."""
    path = os.path.join(shard_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: no manifest (is {shard_dir} a directory made by megatok-build-shards?)") from None
    except (OSError, ValueError) as exn:
        raise DataError(f"{path}: unreadable manifest: {exn}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise DataError(f"{path}: manifest version {manifest.get('version')}, this code reads version {VERSION}")
    for split in ("train", "val"):
        if not isinstance(manifest.get(split), list):
            raise DataError(f'{path}: manifest has no "{split}" shard list')
    return manifest


def verify_shards(shard_dir: str) -> list[str]:
    """Check every shard listed in the manifest against its size and sha256; return the problems found."""
    manifest = read_manifest(shard_dir)
    problems = []
    for split in ("train", "val"):
        for entry in manifest[split]:
            path = os.path.join(shard_dir, entry["name"])
            if not os.path.isfile(path):
                problems.append(f"{path}: missing")
            elif "file_bytes" in entry and os.path.getsize(path) != entry["file_bytes"]:
                problems.append(f"{path}: size {os.path.getsize(path)}, manifest says {entry['file_bytes']}")
            elif _sha256(path) != entry["sha256"]:
                problems.append(f"{path}: sha256 does not match the manifest")
    return problems
