"""How documents become ids: raw bytes (megatok) or sentencepiece BPE tokens (the baseline).

An encoding turns one document into ``[separator] + ids`` (the separator marks the document
boundary in packed sequences and is trained on but never counted as text) and names the id that
pads positions carrying no data. The data pipeline and the evaluators take an encoding, so the
byte model and the BPE token model read the same shards, packed by the same rule.
"""

from __future__ import annotations

import numpy as np

from megatok.bpe import TokenizerError, encode_bytes, load_tokenizer, token_byte_lengths, token_bytes
from megatok.config import ConfigError
from megatok.vocab import PAD, SEP


class ByteEncoding:
    """Ids 0-255 are the bytes; SEP before every document; PAD for padding."""

    sep, pad, dtype, byte_lengths = SEP, PAD, np.int16, None

    def doc_ids(self, doc: bytes) -> np.ndarray:
        ids = np.empty(len(doc) + 1, dtype=self.dtype)
        ids[0] = self.sep
        ids[1:] = np.frombuffer(doc, dtype=np.uint8)
        return ids


BYTES = ByteEncoding()


class BpeEncoding:
    """A byte-exact sentencepiece tokenizer (megatok.bpe): ``</s>`` before every document, ``<unk>``
    (which byte fallback never produces) for padding. ``byte_lengths[i]`` is the number of bytes id i
    stands for. Picklable for dataloader workers: the processor is reloaded from the file there."""

    dtype = np.int32

    def __init__(self, path: str):
        self.path = str(path)
        sp = self._processor()
        self.sep, self.pad = sp.eos_id(), sp.unk_id()
        if self.sep < 0 or self.pad < 0:
            raise ConfigError(f"{self.path}: the tokenizer needs </s> and <unk> pieces (train it with megatok-train-bpe)")
        self.byte_lengths = token_byte_lengths(sp, range(sp.get_piece_size()))

    def _processor(self):
        if getattr(self, "_sp", None) is None:
            self._sp = load_tokenizer(self.path)
        return self._sp

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_sp"}

    def pieces(self) -> list[bytes]:
        """The bytes each id stands for (control ids: none)."""
        return token_bytes(self._processor())

    def doc_ids(self, doc: bytes) -> np.ndarray:
        return np.asarray([self.sep] + encode_bytes(self._processor(), doc), dtype=self.dtype)


def encoding_for(cfg):
    """The encoding of a config's model kind; for "bpe" the tokenizer must exist and fit model.vocab_size."""
    if cfg.model.kind != "bpe":
        return BYTES
    try:
        enc = BpeEncoding(cfg.model.tokenizer)
    except (FileNotFoundError, TokenizerError) as e:
        raise ConfigError(f"model.tokenizer: {e}") from None
    if len(enc.byte_lengths) > cfg.model.vocab_size:
        raise ConfigError(f"model.tokenizer: {cfg.model.tokenizer} has {len(enc.byte_lengths)} pieces, more than "
                          f"model.vocab_size={cfg.model.vocab_size}")
    return enc
