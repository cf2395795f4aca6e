"""Evaluation during training: the validation sequences, split over ranks so that the figure does
not depend on the world size, the validation row (with a data mixture, also per source), and the
Evaluation callback that runs it and the head-to-head at their steps and owns what a stop left pending."""

from __future__ import annotations

import math

import torch

from megatok.config import Config
from megatok.data.stream import iter_shard_documents, pack_documents, validation_sources
from megatok.eval.bpb import boundary_rule, evaluate_batches
from megatok.eval.head_to_head import HeadToHead
from megatok.metrics import MetricsLogger
from megatok.stats import ratios
from megatok.train.callbacks import Callback
from megatok.train.dist import sum_over_ranks


def validation_batches(cfg: Config, rank: int, world: int, encoding) -> list[tuple]:
    """This rank's share of the validation batches, each with its global index (which seeds its boundary
    samples). The sequences are cut into global batches the same way at every world size and batch i
    goes to rank i % world, so the figure does not depend on the number of ranks. Every rank gets the
    same number of batches (all-padding ones, index -1, where it runs out: ZeRO-3 needs every rank in
    every forward). With a mixture each batch also carries the source of each row."""
    seq_len = cfg.data.seq_len
    sources, weights = validation_sources(cfg.data.shards, cfg.data.val_shards)
    seqs, labels = [], []
    for source, (urls, n_seq) in enumerate(zip(sources, mixture_shares(cfg.eval.max_sequences, weights))):
        need, docs, have = n_seq * seq_len + 1, [], 0
        for d in iter_shard_documents(urls):  # read only as much as the validation budget needs
            docs.append(d.text)
            have += len(d.text) + 1 if encoding.byte_lengths is None else len(encoding.doc_ids(d.text))
            if have >= need:
                break
        seqs.append(pack_documents(docs, seq_len, encoding)[:n_seq])
        labels.append(torch.full((len(seqs[-1]),), source))
    seqs, labels = torch.cat(seqs), torch.cat(labels)
    bs = cfg.eval.batch_size or cfg.train.micro_batch_size
    n_global = math.ceil(len(seqs) / bs)
    pad = (-1, torch.full((1, seq_len + 1), encoding.pad, dtype=torch.long), torch.tensor([-1]))
    mine = [(i, seqs[i * bs:(i + 1) * bs], labels[i * bs:(i + 1) * bs]) for i in range(rank, n_global, world)]
    mine += [pad] * (max(1, math.ceil(n_global / world)) - len(mine))
    return mine if weights else [b[:2] for b in mine]


def mixture_shares(n: int, weights: list[float] | None) -> list[int]:
    """n split over a mixture's sources in proportion to the weights (largest remainders; at least 1 each)."""
    if weights is None:
        return [n]
    exact = [n * w / sum(weights) for w in weights]
    shares = [max(1, math.floor(x)) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])[:max(0, n - sum(shares))]:
        shares[i] += 1
    return shares


def validate(engine, cfg: Config, batches, device, step: int, logger: MetricsLogger) -> dict:
    """Validation row: figures over all sequences, and with a mixture also per source ("by_source")."""
    spec = cfg.data.val_shards or cfg.data.shards
    sources = list(spec) if isinstance(spec, dict) else []
    sums = evaluate_batches(engine, batches, mode=cfg.eval.boundary_mode, seed=cfg.eval.seed, device=device,
                            groups=len(sources))
    sums = sum_over_ranks({k: torch.tensor(v, dtype=torch.float64) for k, v in sums.items()}, device)
    row = {"step": step, "split": "val", **{f"val_{k}": v for k, v in ratios(sums).items()},
           "val_bytes": sums["targets"]}
    if sources:
        row["by_source"] = {}
        for g, name in enumerate(sources):
            part = {k.rpartition("/")[0]: v for k, v in sums.items() if k.rpartition("/")[2] == str(g)}
            row["by_source"][name] = {**{f"val_{k}": v for k, v in ratios(part).items()}, "val_bytes": part["targets"]}
    if cfg.model.kind == "unet":
        row["boundary_rule"] = boundary_rule(cfg.eval.boundary_mode, cfg.eval.seed)
    logger.log(row)
    return row


class Evaluation(Callback):
    """Validation and, when configured (eval.heldout, eval.baseline_run or eval.bpe_tokenizer), the
    head-to-head, at every eval.every steps and at the last (:meth:`due`), unless the run is stopping:
    then the checkpoint records the evaluation as pending (its state, the checkpoint's "evaluation"
    part), and the resumed run does it first, once (the checkpoint's record is updated)."""

    state_key = "evaluation"

    def __init__(self, cfg: Config, rank: int, world: int, encoding, device):
        self.cfg, self.device = cfg, device
        self.every, self.max_steps = cfg.eval.every, cfg.train.max_steps
        self.batches = validation_batches(cfg, rank, world, encoding)
        self.h2h = HeadToHead(cfg, rank, world) if cfg.eval.head_to_head else None
        self.pending = False

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def run(self, engine, step: int, logger: MetricsLogger, bytes_seen: float) -> None:
        """Collective: log the rows of step ``step`` for the DeepSpeed ``engine``, which is left training;
        the head-to-head matches its baseline by ``bytes_seen``."""
        validate(engine, self.cfg, self.batches, self.device, step, logger)
        if self.h2h is not None:
            self.h2h.run(engine, step, self.device, logger, bytes_seen=bytes_seen)
        engine.train()

    def on_fit_start(self, trainer):
        if self.pending:
            trainer.progress(f"evaluating step {trainer.step} (left pending by the stop)")
            self._evaluate(trainer)
            self.pending = False
            if trainer.rank == 0:  # once: a rerun of a finished run must not log it again
                trainer.checkpointer.update(trainer.start.name, self.state_key, self.state_dict())

    def on_step_end(self, trainer):
        due = self.due(trainer.step)
        self.pending = due and trainer.stopping
        if due and not trainer.stopping:
            trainer.progress(f"evaluating step {trainer.step}")
            self._evaluate(trainer)

    def _evaluate(self, trainer) -> None:
        with trainer.metrics.paused():  # not training time
            self.run(trainer.engine.ds, trainer.step, trainer.logger, trainer.metrics.bytes_seen)

    def state_dict(self) -> dict:
        return {"pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.pending = state["pending"]
