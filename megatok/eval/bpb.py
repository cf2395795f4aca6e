"""Bits per byte and boundary statistics, for periodic validation and for megatok-evaluate.

Everything is accumulated as sums (NLL in nats, target bytes, chunks, positions, ...) so results
from several batches, documents or ranks add up exactly; ratios are taken only at the end.
Sampled boundaries make BPB stochastic, so evaluation always seeds the sampler (and restores the
caller's RNG state afterwards) or uses a deterministic rule; ``boundary_rule`` says which.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import nullcontext

import torch

from megatok.boundaries.base import row_seeds
from megatok.data.encoding import BYTES
from megatok.stats import ratios

def boundary_rule(mode: str, seed: int) -> str:
    return f"sample(seed={seed})" if mode == "sample" else mode


def row_sums(model, tokens: torch.Tensor, outputs: list | None = None) -> dict[str, torch.Tensor]:
    """Forward one [B, T+1] batch; statistics per row (megatok.stats.row_stats, or
    megatok.model.token_lm.token_row_stats for the BPE token model). ``outputs``: a list the model's
    whole Output is appended to (per-position losses, logits, boundaries)."""
    out = model(tokens[:, :-1], tokens[:, 1:])
    if outputs is not None:
        outputs.append(out)
    return out.rows


def _set_eval_mode(module, mode: str) -> None:
    if hasattr(module, "boundary"):  # the BPE token model has no boundaries
        module.boundary.eval_mode = mode


class Seeded:
    """Run a block with a fixed torch seed and give the caller its RNG state back afterwards."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self.state = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.state)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@torch.no_grad()
def evaluate_batches(model, batches: Iterable[tuple], *, mode: str, seed: int, device,
                     groups: int = 0) -> dict[str, float]:
    """Sum statistics over (index, batch of packed sequences[, group of each row]) tuples; a batch's
    boundary samples are seeded by its index, not by its place in this list. With ``groups`` > 0
    (e.g. a mixture's sources) every statistic is also summed per group, as "<key>/<group>", all keys
    present even where a group has no rows. ``model`` may be a DeepSpeed engine."""
    module = getattr(model, "module", model)
    was_training = module.training
    module.eval()
    _set_eval_mode(module, mode)
    totals: dict[str, torch.Tensor] = {}  # float64 on the device: one host sync at the end
    try:
        for index, tokens, *labels in batches:
            with Seeded(seed * 1_000_003 + index):
                rows = row_sums(model, tokens.to(device))
            if groups:
                g = labels[0].to(device)
                real = g >= 0  # padding rows carry -1
            for k, v in rows.items():
                totals[k] = totals.get(k, 0) + v.sum().double()
                if groups:
                    part = torch.zeros(groups, dtype=torch.float64, device=v.device)
                    totals[f"{k}/"] = totals.get(f"{k}/", 0) + part.index_add_(0, g[real], v[real].double())
    finally:
        module.train(was_training)
    out = {}
    for k, v in totals.items():
        if k.endswith("/"):
            out.update({f"{k}{i}": x for i, x in enumerate(v.tolist())})
        else:
            out[k] = v.item()
    return out


def window_seed(seed: int, text: bytes, window: int) -> int:
    """The seed of a document window's sampled boundaries: from the evaluation seed, the document's
    bytes and the window's index in it, so a document gets the same boundaries whatever else is
    evaluated with it, in which order, batch size or number of ranks."""
    digest = hashlib.blake2b(text, digest_size=8, key=f"{seed}:{window}".encode()).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def document_windows(text: bytes, seq_len: int, encoding=BYTES) -> list[torch.Tensor]:
    """One document as [separator] + ids, cut into windows of seq_len + 1 with an overlap of one
    token, so every byte (or token) of the document is predicted exactly once (the separator is
    context only)."""
    ids = torch.from_numpy(encoding.doc_ids(text).astype("int64"))
    return [ids[i:i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]


class _DocumentSums:
    """evaluate_documents' sums: per group (all documents, each ``lang``, each ``domain``) and per document
    (nll, targets), mergeable over ranks; the figures are taken from them only at the end."""

    def __init__(self):
        self.groups: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.per_doc: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])  # nll, bytes
        self.meta: dict[int, tuple[str, str]] = {}  # document number -> (lang, domain)

    def add(self, doc_no: int, row: dict[str, float]) -> None:
        for key in _keys(self.meta[doc_no]):
            for k, v in row.items():
                self.groups[key][k] += v
        self.per_doc[doc_no][0] += row["nll"]
        self.per_doc[doc_no][1] += row["targets"]

    def merge(self, gather) -> None:
        """Every rank's sums, added (``gather(obj)`` returns every rank's obj)."""
        parts = gather(({k: dict(v) for k, v in self.groups.items()}, dict(self.per_doc)))
        self.groups, self.per_doc = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: [0.0, 0.0])
        for part_groups, part_docs in parts:
            for key, sums in part_groups.items():
                for k, v in sums.items():
                    self.groups[key][k] += v
            for doc_no, (nll, n) in part_docs.items():
                self.per_doc[doc_no][0] += nll
                self.per_doc[doc_no][1] += n

    def result(self) -> dict:
        doc_bpb: dict[tuple[str, str], list[float]] = defaultdict(list)
        for doc_no, (nll, n) in self.per_doc.items():
            for key in _keys(self.meta[doc_no]):
                doc_bpb[key].append(nll / n / math.log(2) if n else float("nan"))

        def report(key):
            s = self.groups[key]
            return {"documents": len(doc_bpb[key]), "bytes": int(s["targets"]), **ratios(s),
                    "bpb_doc_mean": sum(doc_bpb[key]) / max(1, len(doc_bpb[key]))}

        result = report(("all", "all"))
        for kind in ("lang", "domain"):
            names = sorted(n for k, n in self.groups if k == kind)
            if names != ["unknown"]:
                result[f"by_{kind}"] = {n: report((kind, n)) for n in names}
        return result


def _window_batch(model, batch: list, batch_no: int, *, pad: int, seed: int, sampled: bool, device,
                  sums: _DocumentSums, per_window) -> None:
    """One batch of (document number, window, document, window index), right-padded, through the model;
    its rows' sums added to ``sums``."""
    width = max(len(w) for _, w, _, _ in batch)
    tokens = torch.full((len(batch), width), pad, dtype=torch.long)
    for row, (_, w, _, _) in enumerate(batch):
        tokens[row, :len(w)] = w
    seeds = row_seeds([window_seed(seed, text, i) for _, _, text, i in batch]) if sampled else nullcontext()
    outputs = [] if per_window is not None else None
    with Seeded(seed * 1_000_003 + batch_no), seeds:
        cols = {k: v.cpu().tolist() for k, v in row_sums(model, tokens.to(device), outputs).items()}
    if per_window is not None:
        for row, (doc_no, w, _, i) in enumerate(batch):
            per_window(doc_no, i, w, outputs[0], row)
    for i, (doc_no, _, _, _) in enumerate(batch):
        sums.add(doc_no, {k: cols[k][i] for k in cols})


@torch.no_grad()
def evaluate_documents(model, docs: Iterator, *, seq_len: int, batch_size: int, mode: str, seed: int,
                       device, progress=None, encoding=BYTES, share: tuple[int, int] | None = None,
                       gather=None, per_window=None, windows=None, buffer: int = 64) -> dict:
    """Per-document evaluation with breakdowns by the documents' ``lang`` and ``domain``. ``encoding``
    turns documents into the model's ids (megatok.data.encoding.encoding_for(cfg)); for every model,
    "bytes" and bpb are over the documents' UTF-8 bytes.

    Windows are read ``batch_size`` at a time, padded to the longest of their batch: up to ``buffer``
    batches of windows are collected, sorted by length (longest first) and cut into batches, so that
    windows of about the same length share a batch and little padding is computed. The figures are sums
    over windows: the order changes them by float rounding only.

    Split over ranks: with ``share=(rank, world)`` this process runs only batches rank, rank + world,
    ...; ``gather(obj)`` must return every rank's obj (torch.distributed.all_gather_object) and the
    partial sums are merged, so every rank returns the same result as one process would.

    Sampled boundaries: each window draws its own (:func:`window_seed`: the seed, the document's bytes,
    the window's index), so a document's figures do not depend on the batch size, the order of the
    documents or what else is evaluated with it.

    ``per_window(doc_no, window_index, window, output, row)`` is called for every window after its
    batch's forward (windows in the order their batches run, not the documents'), with the model's Output
    for the batch and the window's row in it (megatok.api reads per-position log-probabilities and
    boundaries there).

    ``windows(doc_no, text)``: the document's windows instead of :func:`document_windows` (megatok.api
    reads a long context's continuation in windows that end at it); the figures then sum over every
    target of every window given, so they are megatok-evaluate's only for the default windows."""
    module = getattr(model, "module", model)
    was_training = module.training
    module.eval()
    _set_eval_mode(module, mode)
    sums = _DocumentSums()
    pending: list[tuple[int, torch.Tensor, bytes, int]] = []  # (document number, window, document, window index)
    batch_no = 0

    def flush():
        """The buffered windows, longest first, batch by batch (with ``share``: this rank's batches)."""
        nonlocal batch_no
        pending.sort(key=lambda item: -len(item[1]))  # stable: equal lengths keep the documents' order
        for lo in range(0, len(pending), batch_size):
            if share is None or batch_no % share[1] == share[0]:
                _window_batch(model, pending[lo:lo + batch_size], batch_no, pad=encoding.pad, seed=seed,
                              sampled=mode == "sample" and hasattr(module, "boundary"), device=device,
                              sums=sums, per_window=per_window)
            batch_no += 1
        pending.clear()

    for doc_no, d in enumerate(docs):
        sums.meta[doc_no] = (d.lang or "unknown", d.domain or "unknown")
        cuts = document_windows(d.text, seq_len, encoding) if windows is None else windows(doc_no, d.text)
        for i, w in enumerate(cuts):
            pending.append((doc_no, w, d.text, i))
            if len(pending) == batch_size * max(1, buffer):
                flush()
        if progress is not None:
            progress.update(len(d.text) if isinstance(d.text, bytes) else len(d.text.encode("utf-8", "surrogatepass")))
    flush()
    module.train(was_training)
    if gather is not None:
        sums.merge(gather)
    return sums.result()


def _keys(lang_domain: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return ("lang", lang_domain[0]), ("domain", lang_domain[1]), ("all", "all")
