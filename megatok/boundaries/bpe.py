"""BPE-guided boundaries: chunks start where a trained sentencepiece BPE tokenizer's tokens start.

Two rules (``rule``):

- ``causal`` (default, the one to train and evaluate with): a greedy left-to-right walk over the
  tokenizer's vocabulary. Every piece is mapped to its exact bytes ("\u2581" is a space, byte-fallback
  pieces <0xNN> are the byte NN); a trie holds all of them. The current chunk is extended by x_t
  while (chunk + x_t) is still a prefix of some piece; otherwise a chunk starts at t. The decision
  at t reads bytes <= t only. With byte fallback every byte is a piece, so a chunk can always start;
  like the tokenizer's byte-fallback tokens, a character that no piece covers is split into its bytes.
- ``exact``: sentencepiece's own tokenization of the whole window, token starts mapped to byte
  offsets (the offsets sentencepiece reports; each byte-fallback piece covers one byte). NOT causal: BPE merges look ahead, so whether a token starts at t can
  depend on bytes after t ("in" + "g" vs "i" + "ng..."), which would leak the next byte into the
  prediction at t. For pictures and for measuring how close the causal rule is; never train with it.

SEP (between packed documents) and PAD are their own chunks; the byte after SEP starts a new one.
Invalid UTF-8 bytes start their own chunk under ``exact`` (sentencepiece reads text, not bytes).
Nothing is learned; the rate is the tokenizer's (choose its vocabulary size for the target rate).

Train the tokenizer with megatok-train-bpe (the same one the BPE token model uses):
    megatok-train-bpe --data data/shards --vocab-size 4096 --out runs/bpe4k
    --set boundary.strategy=bpe boundary.model_path=runs/bpe4k/tokenizer.model
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from megatok.boundaries.base import Boundaries, BoundaryStrategy, finalize_starts
from megatok.bpe import TokenizerError, load_tokenizer, token_bytes


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str = Field("", validate_default=True, description="bpe: tokenizer.model from megatok-train-bpe (required)")
    rule: Literal["causal", "exact"] = Field("causal", description="bpe: causal = greedy walk over the vocabulary (bytes <= t only); exact = sentencepiece on the whole window (NOT causal, analysis only)")

    @field_validator("model_path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not v:
            raise ValueError("the bpe strategy needs a sentencepiece model: set boundary.model_path "
                             "(megatok-train-bpe --data data/shards --vocab-size 4096 --out runs/bpe4k trains one)")
        if not Path(v).is_file():
            raise ValueError(f"{v}: no such file")
        try:
            load_tokenizer(v)
        except TokenizerError as e:
            raise ValueError(str(e)) from None
        return v


# --------------------------------------------------------------------------- vocabulary


def build_trie(pieces: Iterable[bytes]) -> list[dict[int, int]]:
    """Node 0 is the root; trie[node][byte] -> child. Every node is a prefix of some piece."""
    trie: list[dict[int, int]] = [{}]
    for p in pieces:
        node = 0
        for byte in p:
            nxt = trie[node].get(byte)
            if nxt is None:
                nxt = len(trie)
                trie[node][byte] = nxt
                trie.append({})
            node = nxt
    return trie


def causal_starts(ids: list[int], trie: list[dict[int, int]]) -> list[bool]:
    """Greedy: extend the chunk while it stays a prefix of a piece, else start a chunk at t."""
    out = [False] * len(ids)
    node = -1  # -1: no chunk open (start of the sequence, after a special, after a byte no piece has)
    for t, v in enumerate(ids):
        if v >= 256:  # SEP / PAD: a chunk of its own
            out[t], node = True, -1
            continue
        nxt = trie[node].get(v) if node >= 0 else None
        if nxt is None:
            out[t] = True
            nxt = trie[0].get(v, -1)
        node = nxt
    return out


def _text_runs(data: bytes):
    """(byte offset, str) runs of valid UTF-8, and (offset, None) for each invalid byte."""
    text = data.decode("utf-8", errors="surrogateescape")
    offset, run = 0, []
    for ch in text:
        if "\udc80" <= ch <= "\udcff":  # an undecodable byte
            if run:
                s = "".join(run)
                yield offset, s
                offset += len(s.encode("utf-8"))
                run = []
            yield offset, None
            offset += 1
        else:
            run.append(ch)
    if run:
        yield offset, "".join(run)


def exact_starts(ids: list[int], sp) -> list[bool]:
    """Token starts of sentencepiece's tokenization (of each stretch between specials), in bytes."""
    out = [False] * len(ids)
    t = 0
    while t < len(ids):
        if ids[t] >= 256:
            out[t] = True
            t += 1
            continue
        end = t
        while end < len(ids) and ids[end] < 256:
            end += 1
        for offset, run in _text_runs(bytes(ids[t:end])):
            if run is None:
                out[t + offset] = True
                continue
            cursor = 0  # the next byte of the run no piece has covered yet
            for piece in sp.encode(run, out_type="proto").pieces:
                if sp.is_byte(piece.id):  # byte fallback: one byte each, in order
                    out[t + offset + cursor] = True
                    cursor += 1
                elif piece.end > piece.begin:  # (the dummy-prefix "\u2581" covers no byte)
                    out[t + offset + piece.begin] = True
                    cursor = piece.end
        t = end
    return out


@lru_cache(maxsize=8)
def tokenizer_and_trie(path: str):
    """The tokenizer (megatok.bpe.load_tokenizer: checked to encode bytes exactly) and the trie of the
    exact bytes of its pieces (byte pieces are their byte; control pieces have none)."""
    sp = load_tokenizer(path)
    return sp, build_trie(p for p in token_bytes(sp) if p)


# --------------------------------------------------------------------------- strategy


class Strategy(BoundaryStrategy):
    def __init__(self, *, d_model, target_rate, options: Options):
        super().__init__(d_model=d_model, target_rate=target_rate, options=options)
        self.sp, self.trie = tokenizer_and_trie(str(Path(options.model_path).resolve()))

    @classmethod
    def param_count(cls, options: Options, *, d_model: int, target_rate: float) -> int:
        return 0  # nothing learned (and the tokenizer need not be read to say so)

    @classmethod
    def model_files(cls, options: Options) -> dict[str, str]:
        return {"model_path": options.model_path}

    def starts_for(self, rows: list[list[int]]) -> list[list[bool]]:
        if self.options.rule == "exact":
            return [exact_starts(r, self.sp) for r in rows]
        return [causal_starts(r, self.trie) for r in rows]

    def forward(self, h, x, mask, forced) -> Boundaries:
        rows = x.masked_fill(~mask, 0).tolist()
        starts = torch.tensor(self.starts_for(rows), dtype=torch.bool).view(x.shape).to(x.device)
        return Boundaries(starts=finalize_starts(starts, mask, forced))
