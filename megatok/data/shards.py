"""Writing documents into WebDataset tar shards, with a manifest.

One sample per document: key "%010d" % document index, "bin" = the raw bytes, "json" = {"lang",
"domain", "source"}. The build runs in two passes so every shard is a random mix of all sources in
a random order (otherwise a reader would see one language, then the next, for a whole shard):

1. read the inputs once, unit by unit (a file, or row groups of a large parquet file: see
   megatok.data.documents), appending each unit's documents to a spill file of its own in the
   temporary directory and keeping only (offset, lengths, metadata codes) in memory;
2. choose the val documents, shuffle the rest and cut them into shards of equal document counts,
   then copy each shard's documents out of the spill files into a tar.

With ``workers`` > 1 both passes run in that many processes (units in pass 1, shards in pass 2); the
documents are numbered and shuffled in the main process from the units' results taken in input
order, so the shards are byte for byte those of a one-process build.

Everything is written into "<out_dir>.tmp-<pid>" and renamed into place at the end, so a failed
or interrupted build never leaves a half-written shard directory or damages an existing one.
"""

import hashlib
import io
import json
import math
import multiprocessing
import os
import shutil
import tarfile
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone

import numpy as np
from tqdm import tqdm

from megatok.data.documents import DataError, Fields, Unit, list_input_files, unit_documents, units_of

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
    """Input size from the sizes on disk; gzip, zstd and parquet are assumed to compress text about 3x."""
    return sum(os.path.getsize(f) * (3 if f.endswith((".gz", ".zst", ".parquet")) else 1) for f in files)


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


def _bytes_by(labels: list[str], codes: np.ndarray, lens: np.ndarray, indices) -> dict[str, int]:
    """Bytes of the documents ``indices`` by label (``labels[codes[i]]``), sorted by label."""
    out: dict[str, int] = {}
    for i in indices:
        key = labels[codes[i]]
        out[key] = out.get(key, 0) + int(lens[i])
    return dict(sorted(out.items()))


def _copies(weights: np.ndarray, seed: int, first: np.ndarray) -> np.ndarray:
    """Copies of each document for mixture weights: floor(w), plus one more with probability w - floor(w)
    (decided by (seed, index of the input document's first piece) alone, like the val split)."""
    base = np.floor(weights)
    extra = np.array([_val_score(seed + 7919, int(i)) for i in first]) < weights - base
    return (base + extra).astype(np.int64)


# ----------------------------------------------------------------------------- pass 1: read


def _read_unit(job) -> dict:
    """Pass 1 for one unit (in a worker process or not): its documents appended to its own spill file
    (text then metadata JSON per document); returns their lengths, pieces and metadata as codes."""
    number, unit, tmp, fields, lang, domain, max_doc_bytes = job
    stats: dict = {}
    text_lens, meta_lens, pieces, lang_codes, domain_codes = [], [], [], [], []
    langs: dict = {}
    domains: dict = {}
    with open(os.path.join(tmp, _spill_name(number)), "wb", buffering=1 << 20) as spill:
        for doc in unit_documents(unit, fields=fields, lang=lang, domain=domain, max_doc_bytes=max_doc_bytes,
                                  stats=stats):
            meta = json.dumps({"lang": doc.lang, "domain": doc.domain, "source": doc.source}).encode()
            spill.write(doc.text)
            spill.write(meta)
            text_lens.append(len(doc.text))
            meta_lens.append(len(meta))
            pieces.append(doc.piece)
            lang_codes.append(langs.setdefault(doc.lang, len(langs)))
            domain_codes.append(domains.setdefault(doc.domain, len(domains)))
    return {"text_lens": np.array(text_lens, dtype=np.int64), "meta_lens": np.array(meta_lens, dtype=np.int64),
            "pieces": np.array(pieces, dtype=np.int64), "langs": list(langs), "domains": list(domains),
            "lang_codes": np.array(lang_codes, dtype=np.int32), "domain_codes": np.array(domain_codes, dtype=np.int32),
            "stats": stats}


def _spill_name(number: int) -> str:
    return f"documents-{number:06d}.spill"


class _Documents:
    """Pass 1's results, in input order: for document i, the unit whose spill file holds it, its
    offset there, its text and metadata lengths, its first piece's index and its lang and domain."""

    def __init__(self):
        self.parts: list[dict] = []
        self.count = 0
        self.stats = {"empty_documents": 0, "split_documents": 0}
        self.langs: dict = {}
        self.domains: dict = {}

    def add(self, number: int, part: dict) -> None:
        n, start = len(part["text_lens"]), self.count
        self.count += n
        ends = np.cumsum(part["text_lens"] + part["meta_lens"])
        # global codes for this unit's local ones, in order of first appearance in the input
        lang_map = np.array([self.langs.setdefault(v, len(self.langs)) for v in part["langs"]], dtype=np.int32)
        domain_map = np.array([self.domains.setdefault(v, len(self.domains)) for v in part["domains"]], dtype=np.int32)
        self.parts.append({
            "unit": np.full(n, number, dtype=np.int32), "offset": ends - part["text_lens"] - part["meta_lens"],
            "text_lens": part["text_lens"], "meta_lens": part["meta_lens"],
            "first": start + np.arange(n, dtype=np.int64) - part["pieces"],
            "lang": lang_map[part["lang_codes"]] if n else np.zeros(0, np.int32),
            "domain": domain_map[part["domain_codes"]] if n else np.zeros(0, np.int32)})
        for key in self.stats:
            self.stats[key] += part["stats"].get(key, 0)

    def column(self, key: str) -> np.ndarray:
        parts = [p[key] for p in self.parts]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------- pass 2: write


def _member(name: str, size: int) -> tarfile.TarInfo:
    """A tar member's header as webdataset's TarWriter writes it (mode 0444, owner "bigdata"), with
    mtime 0 so that a build repeats byte for byte."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o444, "bigdata", "bigdata"
    return info


def _write_shard(job) -> dict:
    """Copy documents out of the spill files into one tar (in a worker process or not); return its
    manifest entry. A document's repeat c > 0 (mixture weights) gets the key "<index>_<c>".

    The tar is what ``webdataset.TarWriter(f, encoder=False, mtime=0)`` writes for samples {"__key__",
    "bin", "json"} (tests/data/test_shards.py compares them), written with tarfile in the USTAR
    format directly, so that a worker process does not import webdataset (and with it torch)."""
    path, tmp, keys, copies, units, offsets, text_lens, meta_lens = job
    spills: dict = {}
    n_bytes = 0
    try:
        with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
            for i, c, u, off, tl, ml in zip(keys.tolist(), copies.tolist(), units.tolist(), offsets.tolist(),
                                            text_lens.tolist(), meta_lens.tolist()):
                spill = spills.get(u)
                if spill is None:
                    spill = spills[u] = open(os.path.join(tmp, _spill_name(u)), "rb")
                spill.seek(off)
                record = spill.read(tl + ml)
                key = "%010d" % i + (f"_{c}" if c else "")
                tar.addfile(_member(key + ".bin", tl), io.BytesIO(record[:tl]))
                tar.addfile(_member(key + ".json", ml), io.BytesIO(record[tl:]))
                n_bytes += tl
    finally:
        for spill in spills.values():
            spill.close()
    return {"name": os.path.basename(path), "documents": len(keys), "bytes": n_bytes,
            "file_bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _pool(workers: int):
    """A process pool. Spawned workers, not forked: the caller may hold threads (a progress bar's
    monitor, torch's), and a worker imports little (this module, numpy, the format readers)."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def _build(inputs, files, tmp, *, val_fraction, num_shards, shard_bytes, min_shards, val_shards,
           seed, lang, domain, max_doc_bytes, progress, weights, fields, workers) -> dict:
    """Both passes of the build, writing into the (existing, empty) directory tmp."""
    estimate = _estimate_bytes(files)
    units = units_of(files)
    pool = _pool(workers) if workers > 1 else None
    run = pool.map if pool is not None else map
    try:
        return _passes(inputs, units, tmp, run, estimate=estimate, val_fraction=val_fraction,
                       num_shards=num_shards, shard_bytes=shard_bytes, min_shards=min_shards,
                       val_shards=val_shards, seed=seed, lang=lang, domain=domain, max_doc_bytes=max_doc_bytes,
                       progress=progress, weights=weights, fields=fields)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _read_pass(units: list[Unit], tmp, run, *, estimate, lang, domain, max_doc_bytes, progress, fields) -> _Documents:
    """Pass 1: every unit read once (``run``: map, or a pool's map, which returns results in order). Its bar
    (on a terminal only) grows past a short estimate (compressed input) and ends at 100% after a long one."""
    docs = _Documents()
    with tqdm(total=estimate, unit="B", unit_scale=True, desc="reading", disable=None if progress else True) as bar:
        jobs = ((k, unit, tmp, fields, lang, domain, max_doc_bytes) for k, unit in enumerate(units))
        for k, part in enumerate(run(_read_unit, jobs)):
            docs.add(k, part)
            bar.update(int(part["text_lens"].sum()))
            bar.total = max(bar.total, bar.n)
        bar.total = bar.n
        bar.refresh()
    return docs


def _passes(inputs, units: list[Unit], tmp, run, *, estimate, val_fraction, num_shards, shard_bytes, min_shards,
            val_shards, seed, lang, domain, max_doc_bytes, progress, weights, fields) -> dict:
    docs = _read_pass(units, tmp, run, estimate=estimate, lang=lang, domain=domain, max_doc_bytes=max_doc_bytes,
                      progress=progress, fields=fields)
    lens = docs.column("text_lens")
    n = len(lens)
    if n == 0:
        raise DataError(f"no documents in {', '.join(inputs)} "
                        f"({docs.stats['empty_documents']} empty documents skipped)")
    names = {"lang": list(docs.langs), "domain": list(docs.domains)}
    _check_weights(weights, names)
    lang_of, domain_of = docs.column("lang"), docs.column("domain")

    # pass 2: split, shuffle (train: with each document's copies for the mixture weights), cut, write
    # decided per input document (see _choose_val: a split one holds out a tail of its pieces); the
    # same decisions as before when nothing was split
    first_piece = docs.column("first")
    is_val = _choose_val(np.array([_val_score(seed, int(i)) for i in first_piece]), first_piece, val_fraction)
    n_copies = None
    if any(weights.values()):
        per_lang = np.array([weights["lang"].get(v, 1.0) for v in names["lang"]], dtype=np.float64)
        per_domain = np.array([weights["domain"].get(v, 1.0) for v in names["domain"]], dtype=np.float64)
        n_copies = _copies(per_lang[lang_of] * per_domain[domain_of], seed, first_piece)
    rng = np.random.default_rng(seed)
    splits, repeat = {}, {}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        chosen = np.flatnonzero(mask)
        nth = np.zeros(len(chosen), dtype=np.int64)  # which copy of its document each entry is
        order = rng.permutation(len(chosen))  # drawn as without weights, so the val split is unchanged
        if split == "train" and n_copies is not None:
            counts = n_copies[chosen]
            chosen = np.repeat(chosen, counts)
            nth = np.arange(len(chosen)) - np.repeat(np.cumsum(counts) - counts, counts)
            if not len(chosen):
                raise DataError("the mixture weights leave no training document")
            order = np.random.default_rng([seed, 1]).permutation(len(chosen))
        idx, nth = chosen[order], nth[order]
        if split == "train":
            wanted = num_shards or max(min_shards, math.ceil(estimate / shard_bytes))
        else:
            wanted = val_shards or max(1, min(4, math.ceil(lens[idx].sum() / shard_bytes)))
        n_parts = min(wanted, len(idx))
        splits[split] = np.array_split(idx, n_parts) if len(idx) else []
        repeat[split] = np.array_split(nth, n_parts) if len(idx) else []
    lang_labels = [str(v) for v in names["lang"]]  # "None" for documents without one
    manifest = {
        "format": FORMAT, "version": VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": list(inputs), "fields": {"text": fields.text, "lang": fields.lang, "domain": fields.domain},
        "seed": seed, "val_fraction": val_fraction, "max_doc_bytes": max_doc_bytes,
        "input_bytes": int(lens.sum()),  # the text read (before mixture weights)
        "documents": {s: int(sum(len(c) for c in chunks)) for s, chunks in splits.items()},
        "bytes": {s: int(sum(lens[c].sum() for c in chunks)) for s, chunks in splits.items()},
        "empty_documents_skipped": docs.stats["empty_documents"],
        "split_documents": docs.stats["split_documents"],
        "weights": weights,
        "bytes_by_lang": {s: _bytes_by(lang_labels, lang_of, lens, np.concatenate(c) if len(c) else c)
                          for s, c in splits.items()},
    }
    units_of_doc, offsets, meta_lens = docs.column("unit"), docs.column("offset"), docs.column("meta_lens")
    with tqdm(total=int(lens.sum()), unit="B", unit_scale=True, desc="writing",
              disable=None if progress else True) as bar:  # None: drawn on a terminal only, not into a log
        for split, chunks in splits.items():
            jobs = ((os.path.join(tmp, f"{split}-{k:05d}.tar"), tmp, chunk, repeat[split][k], units_of_doc[chunk],
                     offsets[chunk], lens[chunk], meta_lens[chunk]) for k, chunk in enumerate(chunks))
            manifest[split] = []
            for entry in run(_write_shard, jobs):
                manifest[split].append(entry)
                bar.update(entry["bytes"])
    for k in range(len(docs.parts)):
        os.remove(os.path.join(tmp, _spill_name(k)))
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def _check_weights(weights: dict, names: dict) -> None:
    """A DataError for a mixture weight of a lang or domain that no document has."""
    for key, table in weights.items():
        for value in table:
            if value not in names[key]:
                raise DataError(f"{key} weight {value}={table[value]:g}: no document has {key} {value!r} "
                                f"(found: {', '.join(sorted(map(str, set(names[key]) - {None}))) or 'none'})")


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


def usable_cpus() -> int:
    """The CPUs this process may run on: megatok-build-shards's default number of workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_shards(inputs: list[str], out_dir: str, *, val_fraction: float = 0.01, num_shards: int | None = None,
                 shard_bytes: int = 64 << 20, min_shards: int = 8, val_shards: int | None = None, seed: int = 0,
                 overwrite: bool = False, lang: str | None = None, domain: str | None = None,
                 max_doc_bytes: int = 1 << 20, progress: bool = True, lang_weights: dict[str, float] | None = None,
                 domain_weights: dict[str, float] | None = None, fields: Fields | None = None,
                 workers: int = 1) -> dict:
    """Build train/val WebDataset shards and manifest.json from the inputs; return the manifest.

    ``fields`` names the text, lang and domain fields of JSON-lines, parquet and Arrow records
    (megatok.data.documents.Fields). ``workers`` processes read the inputs and write the shards; the
    shards are the same for any number. The workers are spawned, so a script that asks for more than
    one calls this under ``if __name__ == "__main__":`` (they import the main module).

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
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if max_doc_bytes < 1:
        raise ValueError(f"max_doc_bytes must be positive, got {max_doc_bytes}")
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
                          lang=lang, domain=domain, max_doc_bytes=max_doc_bytes, progress=progress, weights=weights,
                          fields=fields or Fields(), workers=workers)
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
