"""The data stream of a run and where it stands: what a checkpoint's data position depends on (the
layout and a digest of the data), where a resumed stream starts, what a rank's readers have reached,
and the DataStream component that owns this rank's batches."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as tdist

from megatok.config import Config
from megatok.data.stream import PackedByteStream, is_local, make_loader, resolve_sources, unread_pieces
from megatok.run.checkpoints import CheckpointError

if TYPE_CHECKING:
    from megatok.train.checkpointer import Start


def by_source(cfg: Config, values: list, key: str) -> dict:
    """{key: {source: value}} for a data mixture, {} for a single source."""
    return {key: dict(zip(cfg.data.shards, values))} if isinstance(cfg.data.shards, dict) else {}


def source_key(spec: str) -> str:
    """A shard or source as the stream reads it: a local path by its real path (``data/shards``,
    ``./data/shards/`` and its absolute path are one source), a URL as written."""
    return os.path.realpath(spec) if is_local(spec) else spec


def data_digests(cfg: Config) -> dict[str, str]:
    """What the stream reads: the training shards (URL, and size where it is a local file) and the
    encoding. A resume that reads other data cannot continue the same position. Two digests, both
    recorded in every checkpoint: ``data_digest`` counts local files by their real paths (``data/shards``,
    ``./data/shards/`` and the absolute path are the same data), ``data_digest_spelled`` as the config
    spells them (the same data when a project moves with its relative paths)."""
    shards = [[u, os.path.getsize(u) if os.path.isfile(u) else None]
              for urls in resolve_sources(cfg.data.shards, "train", key="data.shards")[0] for u in urls]
    tokenizer = cfg.model.tokenizer if cfg.model.kind == "bpe" else None

    def digest(key) -> str:
        text = json.dumps([[[key(u), size] for u, size in shards], cfg.model.kind,
                           key(tokenizer) if tokenizer else None])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    return {"data_digest": digest(source_key), "data_digest_spelled": digest(lambda u: u)}


def data_matches(state: dict, digests: dict[str, str]) -> bool:
    """Whether a checkpoint's data ``state`` was trained on the data of ``digests`` (:func:`data_digests`)
    by either digest; a checkpoint that records neither is taken to be."""
    recorded = {state[k] for k in ("data_digest", "data_digest_spelled") if state.get(k)}
    return not recorded or bool(recorded & set(digests.values()))


def _canonical(lay: dict) -> dict:
    return {**lay, "mixture": [[source_key(k), w] for k, w in lay["mixture"]]} if "mixture" in lay else lay


def layout_matches(old: dict, cfg: Config, world: int) -> bool:
    """Whether a checkpoint's layout is this run's, a mixture's sources compared as :func:`source_key`s."""
    return _canonical(old) == _canonical(layout(cfg, world))


def layout(cfg: Config, world: int) -> dict:
    """What the data position of a checkpoint depends on (batches consumed per rank = step x accum)."""
    out = {"world_size": world, "micro_batch_size": cfg.train.micro_batch_size, "grad_accum": cfg.train.grad_accum,
           "num_workers": max(1, cfg.data.num_workers), "seq_len": cfg.data.seq_len, "seed": cfg.train.seed}
    if isinstance(cfg.data.shards, dict):  # a mixture: its sources and (normalised) weights
        total = sum(cfg.data.shards.values())
        out["mixture"] = [[k, round(v / total, 12)] for k, v in cfg.data.shards.items()]
    return out


class StreamPosition:
    """What this rank's readers have reached, from the batches it consumed: each source's furthest
    epoch over all its readers (batches come round-robin from the workers, so the last batch alone
    would speak for one worker), the bad shards counted by every reader, and each reader's cursor
    (where its next batch starts; ``cursors`` gives those a resumed run started from)."""

    def __init__(self, start_epochs: list[int], cursors: dict[int, dict] | None = None):
        self.epochs, self._bad = list(start_epochs), {}
        self.cursors = dict(cursors or {})
        for reader, c in self.cursors.items():  # a resumed rank: where its readers were, before any batch
            self.epochs = [max(e, p[0]) for e, p in zip(self.epochs, c["sources"])]
            self._bad[reader] = c["bad_shards"]

    def update(self, batch: dict) -> None:
        self.epochs = [max(a, b) for a, b in zip(self.epochs, batch["epochs"])]
        self._bad[batch["reader"]] = batch["bad_shards"]
        self.cursors[batch["reader"]] = batch["cursor"]

    @property
    def bad_shards(self) -> int:
        return sum(self._bad.values())


def all_cursors(checkpoint: Start, old: dict, n_sources: int) -> dict[int, dict]:
    """Every reader's cursor in ``checkpoint`` (all ranks' files; ``old``: the layout it was written with),
    or {} if any is missing or unreadable."""
    cursors = {}
    try:
        for r in range(old["world_size"]):
            cursors.update(checkpoint.cursors(r, n_sources))
    except CheckpointError:
        return {}
    return cursors if len(cursors) == old["world_size"] * old["num_workers"] else {}


def data_position(meta: dict | None, cfg: Config, world: int, old_cursors: dict[int, dict] | None = None,
                  shard_counts: list[int] | None = None, same_data: bool = True) -> tuple[int, list[int], dict]:
    """(start_batch, start epoch per source, origin) for this rank's stream after resuming from ``meta``
    (a checkpoint's data state with its ``step``).

    Same layout: continue exactly where each reader stopped. A different layout (world size,
    workers, batch split, mixture weights) cannot continue the same readers. With ``old_cursors`` (every
    reader's cursor in the checkpoint, of the same data: ``shard_counts`` shards per source) the new
    readers first share what the old ones had not read of each source's current epoch (see
    megatok.data.stream.unread_pieces): no document of that epoch is skipped, and only the documents
    the old readers were in the middle of are read twice. Otherwise (a checkpoint without every
    reader's cursor, or other data) each source starts its next epoch (matched by name; a new source starts at 0), and
    the documents of the interrupted epoch not yet read are skipped for that epoch. The stream then
    restarts from its first batch; ``origin`` ({"step", "epochs"}, and "unread" when it finishes an
    interrupted epoch) goes into every later checkpoint, so that resuming one of those with the same
    layout continues the restarted stream, not the original one. With other data (``same_data``
    False) the same layout resumes the recorded epochs as they now come, without "unread" pieces,
    whose shard indices described the old shards."""
    names = list(cfg.data.shards) if isinstance(cfg.data.shards, dict) else None
    n = len(names) if names else 1
    if meta is None:
        origin = {"step": 0, "epochs": [0] * n}
    elif layout_matches(meta["layout"], cfg, world):
        origin = meta.get("stream_origin", {"step": 0, "epochs": [0] * n})
        if not same_data:
            origin = {k: v for k, v in origin.items() if k != "unread"}
    else:
        old = meta["layout"]
        old_names = [k for k, _ in old["mixture"]] if "mixture" in old else None
        if old_cursors and shard_counts and (old_names is None) == (names is None) and (
                names is None or list(map(source_key, old_names)) == list(map(source_key, names))):
            epochs, unread = unread_pieces(shard_counts, old_cursors, old["world_size"] * old["num_workers"],
                                           old["seed"], meta.get("stream_origin"))
            origin = {"step": meta["step"], "epochs": epochs, "unread": unread}
            how = (f"finishes epoch {epochs[0] if names is None else dict(zip(names, epochs))} with what the "
                   f"earlier layout had not read ({sum(map(len, unread))} shard pieces), then goes on")
        else:
            epochs = meta.get("epochs", meta["epoch"])  # {source: epoch} for a mixture, else one epoch
            if names and isinstance(epochs, dict):
                epochs = {source_key(k): v for k, v in epochs.items()}
                start = [epochs[source_key(name)] + 1 if source_key(name) in epochs else 0 for name in names]
            else:
                start = [(max(epochs.values()) if isinstance(epochs, dict) else epochs) + 1] * n
            origin = {"step": meta["step"], "epochs": start}
            how = f"starts epoch {start[0] if names is None else dict(zip(names, start))}"
        print(f"megatok: resuming with layout {layout(cfg, world)} instead of {old}: the data stream {how}",
              flush=True)
    start_batch = (meta["step"] - origin["step"]) * cfg.train.grad_accum if meta else 0
    return start_batch, origin["epochs"], origin


class DataStream:
    """This rank's training batches (megatok.data.stream.PackedByteStream through its DataLoader) and
    where they stand (StreamPosition). Its state (state_dict), a checkpoint's "data" part: the layout and
    the data it depends on, each source's furthest epoch over all ranks and the origin of the stream;
    per rank, its readers' ``cursors``, which the checkpointer writes to stream_rank<r>.json."""

    def __init__(self, cfg: Config, encoding, rank: int, world: int, device: torch.device):
        self.cfg, self.encoding, self.rank, self.world, self.device = cfg, encoding, rank, world, device
        self.sources, self.weights = resolve_sources(cfg.data.shards, "train", key="data.shards")
        self.digests = data_digests(cfg)
        self.start_batch, self.start_epochs, self.origin = data_position(None, cfg, world)
        self.resumed_cursors: dict[int, dict] = {}
        self.batches = self.position = None

    def same_layout(self, state: dict) -> bool:
        """Whether a checkpoint's data ``state`` was written with this run's layout (see :func:`layout`)."""
        return layout_matches(state["layout"], self.cfg, self.world)

    def load_state_dict(self, state: dict, checkpoint: Start) -> None:
        """Collective: where the stream continues after the data ``state`` of ``checkpoint`` (its step, and
        the readers' cursors each rank saved in it); rank 0 decides for all ranks.
        Same layout and data: each reader continues from its cursor (a checkpoint without them: it
        regenerates the recorded number of batches). Other shards (whose indices the cursors do not
        describe): the recorded position is regenerated, with a warning. Another layout on the same
        data shares out what the old readers had not read of the current epoch (data_position)."""
        same_layout, same_data = self.same_layout(state), data_matches(state, self.digests)
        if same_layout and not same_data and self.rank == 0:
            print(f"megatok: warning: {checkpoint.name} was trained on other shards or another tokenizer than "
                  f"data.shards / model.tokenizer now give (shard list, sizes or encoding changed): the data "
                  f"position is resumed as recorded, so documents may be repeated or skipped", flush=True)
        decided, meta = [None], {**state, "step": checkpoint.step}
        if self.rank == 0:
            old = all_cursors(checkpoint, state["layout"], len(self.sources)) if not same_layout and same_data else {}
            decided[0] = data_position(meta, self.cfg, self.world, old, list(map(len, self.sources)), same_data)
        tdist.broadcast_object_list(decided, src=0)
        self.start_batch, self.start_epochs, self.origin = decided[0]
        if self.start_batch and same_layout and same_data:
            self.resumed_cursors = checkpoint.cursors(self.rank, len(self.sources))

    def open(self) -> None:
        """Start the readers. A resumed stream seeks to its cursors (or regenerates) now, before training
        starts (and with it the watchdog)."""
        d, t = self.cfg.data, self.cfg.train
        stream = PackedByteStream(self.sources if self.weights else self.sources[0], weights=self.weights,
                                  seq_len=d.seq_len, batch_size=t.micro_batch_size, rank=self.rank,
                                  world_size=self.world, seed=t.seed, start_batch=self.start_batch,
                                  start_epoch=self.start_epochs, on_bad_shard=d.on_bad_shard,
                                  encoding=self.encoding, cursors=self.resumed_cursors,
                                  unread=self.origin.get("unread"))
        batches = iter(make_loader(stream, d.num_workers, pin_memory=self.device.type == "cuda"))
        cursors = self.resumed_cursors
        if self.start_batch:
            t0 = time.time()
            batches = itertools.chain([next(batches)], batches)
            if self.rank == 0:
                how = "at its readers' cursors" if cursors else f"by regenerating {self.start_batch} batches per rank"
                print(f"megatok: data stream resumed {how} in {time.time() - t0:.1f} s", flush=True)
        else:  # a fresh stream: a reader nothing has been consumed from yet is at its start
            workers = max(1, d.num_workers)
            cursors = {r: {**stream.start_state(r)[0], "offset": 0}
                       for r in range(self.rank * workers, (self.rank + 1) * workers)}
        self.batches, self.position = batches, StreamPosition(self.start_epochs, cursors)

    def next_batch(self) -> torch.Tensor:
        """The next [micro_batch_size, seq_len + 1] batch of this rank."""
        batch = next(self.batches)
        self.position.update(batch)
        return batch["tokens"]

    @property
    def cursors(self) -> dict[int, dict]:
        return self.position.cursors

    @property
    def bad_shards(self) -> int:
        """Bad shards this rank's readers have skipped so far."""
        return self.position.bad_shards

    def epochs(self) -> dict:
        """This rank's epoch figures for a training row (a checkpoint's are over all ranks)."""
        return {"epoch": max(self.position.epochs), **by_source(self.cfg, self.position.epochs, "epochs")}

    def state_dict(self) -> dict:
        """Collective (each source's furthest epoch over all ranks): the stream's part of a checkpoint."""
        top = torch.tensor([float(e) for e in self.position.epochs], device=self.device)
        tdist.all_reduce(top, op=tdist.ReduceOp.MAX)
        top_epochs = [int(e) for e in top.tolist()]
        return {"epoch": max(top_epochs), **by_source(self.cfg, top_epochs, "epochs"), "stream_origin": self.origin,
                **self.digests, "layout": layout(self.cfg, self.world)}

    def close(self) -> None:
        """End the data workers now, not at interpreter exit, where they would be waited for: they ignore
        SIGTERM, and a reference left elsewhere to the trainer (wandb keeps the exception of a failed
        init, and with it the frames) would keep the loader alive."""
        self.batches = None
