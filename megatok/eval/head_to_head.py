"""Periodic head-to-head evaluation inside training: this model and a baseline on the same bytes.

At every eval interval (``eval.every``) and when any of ``eval.heldout``, ``eval.baseline_run`` or
``eval.bpe_tokenizer`` is set, the loop calls :meth:`HeadToHead.run`, which scores a fixed set of
documents (``eval.heldout``, default the validation split, read up to ``eval.heldout_max_bytes``)
document by document and logs one ``"split": "h2h"`` row with, side by side:

- ``h2h_bpb`` and ``h2h_bytes_per_chunk`` (``h2h_bytes_per_token`` for a token model): the training model;
- ``h2h_bpe_bytes_per_token``: the BPE tokenizer on the same documents (computed once);
- ``h2h_baseline_bpb``: a checkpoint of ``eval.baseline_run`` (usually the BPE token model at matched
  FLOPs) on exactly the same bytes (summed token NLL over the same UTF-8 byte count), and
  ``h2h_bpb_gap`` = baseline - this model (positive: this model is better). With
  ``eval.baseline_checkpoint`` "matched" (the default) it is the baseline's checkpoint whose training
  bytes are nearest to this model's (``h2h_bytes_seen``, ``h2h_baseline_bytes_seen``): the comparison
  at equal training bytes; with "latest", its latest checkpoint. The baseline is re-scored only when
  that checkpoint changes (it may be training at the same time);
- ``by_lang`` / ``by_domain``: all of the above (with ``h2h_documents`` and ``h2h_bytes``) per "lang" /
  "domain" metadata of the documents. A heldout file larger than ``eval.heldout_max_bytes`` gives
  every (lang, domain) group its turn (heldout_documents); on a parallel set, check that every
  language got the same documents;
- ``h2h_seconds`` and ``h2h_cost_fraction``: time spent here since this process started (a resume starts
  again), and its share of the wall time since then.

The ranks share the documents' batches and merge their sums (under ZeRO-3, where every rank must
take part in every forward, each rank scores all of them); rank 0 alone loads and scores the
baseline, on the training device and in the run's precision (bf16 when the run is: the run is scored
through its bf16 engine, and the baseline was trained so too), frees it, and writes the row.
"""

from __future__ import annotations

import itertools
import time

import torch

from megatok.bpe import bytes_per_token, load_tokenizer
from megatok.config import Config
from megatok.data.documents import DataError, Document
from megatok.data.encoding import encoding_for
from megatok.data.inputs import is_shards, read_documents
from megatok.data.stream import iter_shard_documents, resolve_sources
from megatok.dsconfig import uses_bf16
from megatok.eval.bpb import evaluate_documents
from megatok.run.checkpoints import latest_tag, published_tags, read_meta
from megatok.run.reader import load_model, run_config


def heldout_documents(cfg: Config) -> list[Document]:
    """The head-to-head documents: whole documents until eval.heldout_max_bytes is reached. A shard
    set's val split (shuffled when built) is read in order, taken in turn from each source of a mixture,
    and read no further; a heldout file or directory of documents is read whole and its documents taken
    in turn from each (lang, domain) group (see balanced), so that a file sorted by language keeps every
    language."""
    spec = cfg.eval.heldout or cfg.data.val_shards
    budget = cfg.eval.heldout_max_bytes
    if not cfg.eval.heldout or all(map(is_shards, [spec] if isinstance(spec, str) else spec)):
        if spec is None or isinstance(spec, dict):  # shard sets' val splits (one stream unless a mixture)
            streams = [iter_shard_documents(u) for u in resolve_sources(spec or cfg.data.shards, "val")[0]]
            docs = (d for group in itertools.zip_longest(*streams) for d in group if d is not None)
        else:
            docs = read_documents(spec, "val")
        out, n = [], 0
        for d in docs:
            if n >= budget:
                break
            out.append(d)
            n += len(d.text)
        return out
    return balanced(read_documents(spec, "val"), budget)


def balanced(docs, budget: int) -> list[Document]:
    """Whole documents until ``budget`` bytes, one from each (lang, domain) group in turn (groups in
    the order they first appear, each group's documents in file order), returned in file order. With
    one group (or a file within the budget) this is the file's first documents. Each group keeps at
    most ``budget`` bytes while reading, so memory is bounded by the number of groups."""
    groups: dict[tuple, list] = {}
    for i, d in enumerate(docs):
        kept = groups.setdefault((d.lang, d.domain), [0, []])
        if kept[0] < budget:
            kept[0] += len(d.text)
            kept[1].append((i, d))
    queues = [iter(kept[1]) for kept in groups.values()]
    chosen, n = [], 0
    while queues and n < budget:
        for q in list(queues):
            item = next(q, None)
            if item is None:
                queues.remove(q)
                continue
            chosen.append(item)
            n += len(item[1].text)
            if n >= budget:
                break
    return [d for _, d in sorted(chosen, key=lambda item: item[0])]


def tokenizer_path(cfg: Config) -> str | None:
    """eval.bpe_tokenizer, else the baseline run's tokenizer if it is a BPE token model."""
    if cfg.eval.bpe_tokenizer:
        return cfg.eval.bpe_tokenizer
    if cfg.eval.baseline_run:
        base = run_config(cfg.eval.baseline_run)
        if base.model.kind == "bpe":
            return base.model.tokenizer
    return None


def _all_gather(obj) -> list:
    import torch.distributed as tdist

    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def _unit(result: dict) -> str:
    return "token" if "bytes_per_token" in result else "chunk"


class HeadToHead:
    def __init__(self, cfg: Config, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.encoding = encoding_for(cfg)
        self.docs = heldout_documents(cfg)
        if not self.docs:
            raise DataError(f"eval.heldout: no documents in {cfg.eval.heldout or 'the validation split'}")
        self.tokenizer = None
        path = tokenizer_path(cfg)
        if rank == 0 and path:
            self.tokenizer = {"path": path, **bytes_per_token(load_tokenizer(path), self.docs)}
        self.baseline: tuple[str, dict, float | None] | None = None  # (checkpoint tag, result, its bytes)
        self.seconds, self.started = 0.0, time.time()

    def run(self, engine, step: int, device, logger, bytes_seen: float | None = None) -> dict:
        t0 = time.time()
        e = self.cfg.eval
        split = {}
        if self.world > 1 and engine.zero_optimization_stage() < 3:  # ZeRO-3 needs every rank in every forward
            split = {"share": (self.rank, self.world), "gather": _all_gather}
        mine = evaluate_documents(engine, iter(self.docs), seq_len=self.cfg.data.seq_len,
                                  batch_size=e.batch_size or self.cfg.train.micro_batch_size,
                                  mode=e.boundary_mode, seed=e.seed, device=device, encoding=self.encoding, **split)
        if self.rank != 0:
            self.seconds += time.time() - t0
            return {}
        base = self._baseline(device, bytes_seen)
        row = {"step": step, "split": "h2h", **self._figures(mine, base, self.tokenizer)}
        if bytes_seen is not None:
            row["h2h_bytes_seen"] = bytes_seen
        for kind in ("lang", "domain"):
            if f"by_{kind}" in mine:
                row[f"by_{kind}"] = {
                    name: self._figures(r, (base or {}).get(f"by_{kind}", {}).get(name),
                                        (self.tokenizer or {}).get(f"by_{kind}", {}).get(name))
                    for name, r in mine[f"by_{kind}"].items()}
        if base is not None:
            row["h2h_baseline_run"], row["h2h_baseline_checkpoint"] = e.baseline_run, self.baseline[0]
            if self.baseline[2] is not None:
                row["h2h_baseline_bytes_seen"] = self.baseline[2]
        self.seconds += time.time() - t0
        row["h2h_seconds"] = self.seconds
        row["h2h_cost_fraction"] = self.seconds / max(1e-9, time.time() - self.started)
        logger.log(row)
        return row

    @staticmethod
    def _figures(mine: dict, base: dict | None, tok: dict | None) -> dict:
        unit = _unit(mine)
        out = {"h2h_documents": mine["documents"], "h2h_bytes": mine["bytes"], "h2h_bpb": mine["bpb"],
               f"h2h_bytes_per_{unit}": mine[f"bytes_per_{unit}"]}
        if tok is not None:
            out["h2h_bpe_bytes_per_token"] = tok["bytes_per_token"]
        if base is not None:
            out["h2h_baseline_bpb"] = base["bpb"]
            out[f"h2h_baseline_bytes_per_{_unit(base)}"] = base[f"bytes_per_{_unit(base)}"]
            out["h2h_bpb_gap"] = base["bpb"] - mine["bpb"]
        return out

    def _baseline(self, device, bytes_seen: float | None) -> dict | None:
        """The baseline run's result on the documents, re-scored only when the chosen checkpoint changes."""
        run = self.cfg.eval.baseline_run
        if not run:
            return None
        matched = self.cfg.eval.baseline_checkpoint == "matched" and bytes_seen is not None
        tag, its_bytes = baseline_checkpoint(run, bytes_seen if matched else None)
        if tag is None:
            return None  # no checkpoint yet (the baseline may still be starting)
        if self.baseline is None or self.baseline[0] != tag:
            try:
                # built in the run's precision, one tensor at a time: never a whole fp32 copy beside it
                model, bcfg, tag = load_model(run, tag, device, dtype=torch.bfloat16 if uses_bf16(self.cfg) else None)
            except (OSError, ValueError, RuntimeError) as e:
                # e.g. a baseline still training rotated it out (train.keep_checkpoints) while it was
                # read: a missing file, or DeepSpeed's "fewer optimizer partitions than expected"
                keep = f"this row keeps {self.baseline[0]}" if self.baseline else "no baseline in this row"
                print(f"megatok: warning: eval.baseline_run: {tag} cannot be read ({e}); {keep}", flush=True)
                return self.baseline[1] if self.baseline else None
            result = evaluate_documents(model, iter(self.docs), seq_len=bcfg.data.seq_len,
                                        batch_size=bcfg.eval.batch_size or bcfg.train.micro_batch_size,
                                        mode=bcfg.eval.boundary_mode, seed=bcfg.eval.seed, device=device,
                                        encoding=encoding_for(bcfg))
            del model
            if device.type == "cuda":  # give its memory back to the training
                torch.cuda.empty_cache()
            self.baseline = (tag, result, its_bytes)
        return self.baseline[1]


def baseline_checkpoint(run: str, bytes_seen: float | None) -> tuple[str | None, float | None]:
    """(tag, its training bytes) of run's checkpoint whose ``bytes_seen`` is nearest to ``bytes_seen``
    (the later one on a tie), or with None its latest checkpoint. Checkpoints that do not record their
    bytes (or whose meta cannot be read: being written, damaged) are passed over; (None, None) when
    there is none."""
    def its_bytes(tag):
        try:
            return read_meta(run, tag).get("metrics", {}).get("bytes_seen")
        except (OSError, ValueError):
            return None

    if bytes_seen is None:
        tag = latest_tag(run)
        return tag, its_bytes(tag) if tag else None
    known = [(tag, b) for tag in published_tags(run) if (b := its_bytes(tag)) is not None]
    if not known:
        return baseline_checkpoint(run, None)
    return min(reversed(known), key=lambda tb: abs(tb[1] - bytes_seen))
