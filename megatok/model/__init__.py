"""Models: megatok's byte U-net (model.kind "unet") and the BPE token baseline (model.kind "bpe")."""

from __future__ import annotations

from megatok.data.encoding import encoding_for
from megatok.model.token_lm import TokenLM
from megatok.model.unet import ByteUNet


def build_model(cfg, *, sizing_only: bool = False):
    """The model a config describes. For kind "bpe" this reads the tokenizer (for the bytes each id
    stands for), unless ``sizing_only`` (e.g. on the meta device, where only shapes matter)."""
    if cfg.model.kind == "bpe":
        if sizing_only:
            return TokenLM(cfg.model)
        enc = encoding_for(cfg)
        return TokenLM(cfg.model, enc.byte_lengths, pad_id=enc.pad, sep_id=enc.sep)
    model = ByteUNet(cfg.model, cfg.boundary)
    model.boundary.window = cfg.data.seq_len
    return model
