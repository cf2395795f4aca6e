"""The transformers config of megatok's byte U-net (written by megatok-export; torch and transformers only)."""

from transformers import PretrainedConfig


class MegatokByteConfig(PretrainedConfig):
    """The byte U-net's shape (megatok's ``model`` section, the SwiGLU widths resolved), its boundary
    strategy (``strategy``, ``target_rate``, ``strategy_options``) and the rule its boundaries follow here:
    ``boundary_rule`` "threshold" (a chunk starts where the strategy's probability is above 0.5) or
    "sample" (drawn from a generator seeded by ``boundary_seed`` and the row's bytes).
    ``max_position_embeddings`` is the training window (data.seq_len)."""

    model_type = "megatok_byte"

    def __init__(self, d_model=256, n_heads=4, n_encoder_layers=1, main_width=256, main_heads=4, n_main_layers=2,
                 n_decoder_layers=1, ffn_hidden=704, main_ffn_hidden=704, norm_eps=1e-5, rope_theta=10000.0,
                 byte_window=None, document_mask=False, chunk_capacity=None, strategy="policy", target_rate=0.2,
                 strategy_options=None, boundary_rule="threshold", boundary_seed=0, max_position_embeddings=512,
                 vocab_size=258, sep_token_id=256, pad_token_id=257, **kwargs):
        self.d_model, self.n_heads, self.n_encoder_layers = d_model, n_heads, n_encoder_layers
        self.main_width, self.main_heads, self.n_main_layers = main_width, main_heads, n_main_layers
        self.n_decoder_layers, self.ffn_hidden, self.main_ffn_hidden = n_decoder_layers, ffn_hidden, main_ffn_hidden
        self.norm_eps, self.rope_theta, self.byte_window = norm_eps, rope_theta, byte_window
        self.document_mask, self.chunk_capacity = document_mask, chunk_capacity
        self.strategy, self.target_rate = strategy, target_rate
        self.strategy_options = dict(strategy_options or {})
        if boundary_rule not in ("threshold", "sample"):
            raise ValueError(f"boundary_rule is 'threshold' or 'sample', not {boundary_rule!r}")
        self.boundary_rule, self.boundary_seed = boundary_rule, boundary_seed
        self.max_position_embeddings, self.vocab_size, self.sep_token_id = max_position_embeddings, vocab_size, sep_token_id
        kwargs.setdefault("bos_token_id", sep_token_id)
        kwargs.setdefault("eos_token_id", sep_token_id)
        super().__init__(pad_token_id=pad_token_id, **kwargs)
