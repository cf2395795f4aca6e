"""BPE-guided boundaries: chunks start where a trained sentencepiece BPE tokenizer's tokens start.

Two rules (``rule``):

- ``causal`` (default, the one to train and evaluate with): a greedy left-to-right walk over the
  tokenizer's vocabulary. Every piece is mapped to its exact bytes ("\u2581" is a space, byte-fallback
  pieces <0xNN> are the byte NN); a trie holds all of them. The current chunk is extended by x_t
  while (chunk + x_t) is still a prefix of some piece; otherwise a chunk starts at t. The decision
  at t reads bytes <= t only. With byte fallback every byte is a piece, so a chunk can always start;
  like the tokenizer's byte-fallback tokens, a character that no piece covers is split into its bytes.
- ``exact``: sentencepiece's own tokenization of the whole window, token starts mapped to byte
  offsets (the offsets sentencepiece reports; each byte-fallback piece covers one byte; the dummy
  prefix "\u2581" covers none). NOT causal: BPE merges look ahead, so whether a token starts at t can
  depend on bytes after t ("in" + "g" vs "i" + "ng..."), which would leak the next byte into the
  prediction at t. For pictures and for measuring how close the causal rule is; never train with it.

SEP (between packed documents) and PAD are their own chunks; the byte after SEP starts a new one.
Invalid UTF-8 bytes start their own chunk under ``exact`` (sentencepiece reads text, not bytes).
Nothing is learned; the rate is the tokenizer's (choose its vocabulary size for the target rate).

Train a tokenizer:  python -m megatok.boundaries.bpe --data data/shards --out data/bpe.model --vocab-size 32768
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from megatok.boundaries.base import Boundaries, BoundaryStrategy, finalize_starts


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str = Field("", validate_default=True, description="bpe: a trained sentencepiece BPE model file (required; python -m megatok.boundaries.bpe trains one)")
    rule: Literal["causal", "exact"] = Field("causal", description="bpe: causal = greedy walk over the vocabulary (bytes <= t only); exact = sentencepiece on the whole window (NOT causal, analysis only)")

    @field_validator("model_path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not v:
            raise ValueError("the bpe strategy needs a sentencepiece model: set boundary.model_path "
                             "(python -m megatok.boundaries.bpe --data data/shards --out data/bpe.model trains one)")
        if not Path(v).is_file():
            raise ValueError(f"{v}: no such file")
        return v


# --------------------------------------------------------------------------- vocabulary


def piece_bytes(sp) -> list[bytes]:
    """The exact bytes of every normal, user-defined and byte piece (not <unk>, <s>, </s>, unused)."""
    out = []
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue
        piece = sp.id_to_piece(i)
        out.append(bytes([int(piece[3:5], 16)]) if sp.is_byte(i) else piece.replace("\u2581", " ").encode("utf-8"))
    return [p for p in out if p]


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
def load_tokenizer(path: str):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=path)
    return sp, build_trie(piece_bytes(sp))


# --------------------------------------------------------------------------- strategy


class Strategy(BoundaryStrategy):
    def __init__(self, *, d_model, target_rate, options: Options):
        super().__init__(d_model=d_model, target_rate=target_rate, options=options)
        self.sp, self.trie = load_tokenizer(str(Path(options.model_path).resolve()))

    def starts_for(self, rows: list[list[int]]) -> list[list[bool]]:
        if self.options.rule == "exact":
            return [exact_starts(r, self.sp) for r in rows]
        return [causal_starts(r, self.trie) for r in rows]

    def forward(self, h, x, mask) -> Boundaries:
        rows = x.masked_fill(~mask, 0).tolist()
        starts = torch.tensor(self.starts_for(rows), dtype=torch.bool).view(x.shape).to(x.device)
        return Boundaries(starts=finalize_starts(starts, mask))


# --------------------------------------------------------------------------- training a tokenizer


def train_tokenizer(lines: Iterable[str], out: str | Path, vocab_size: int, **kwargs) -> Path:
    """Train a byte-fallback BPE sentencepiece model on ``lines``; writes ``out`` (a .model file).

    Identity normalisation and no whitespace collapsing, so pieces are the text's exact bytes;
    whitespace-only pieces are allowed (indentation becomes a few pieces, not one per space)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    opts = dict(model_type="bpe", vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, max_sentence_length=1 << 16, minloglevel=2,
                input_sentence_size=2_000_000, shuffle_input_sentence=True)
    opts.update(kwargs)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, **opts)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(buf.getvalue())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Train a sentencepiece BPE model for boundary.strategy=bpe")
    ap.add_argument("--data", nargs="+", required=True,
                    help="text inputs build_shards reads (.txt, .jsonl(.gz), dirs), or a shard directory (its train split)")
    ap.add_argument("--out", required=True, help="output .model file")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args(argv)
    from megatok.data.documents import iter_documents
    from megatok.data.stream import iter_shard_documents, resolve_shards

    def documents():
        for p in args.data:
            if Path(p, "manifest.json").is_file():
                yield from iter_shard_documents(resolve_shards(p, "train"))
            else:
                yield from iter_documents([p])

    def lines():
        for d in documents():
            yield from d.text.decode("utf-8", errors="replace").splitlines()

    path = train_tokenizer(lines(), args.out, args.vocab_size)
    print(f"wrote {path} ({args.vocab_size} pieces)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
