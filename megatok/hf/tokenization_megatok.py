"""megatok's byte tokenizer for transformers (written by megatok-export; transformers only).

Ids 0-255 are the text's UTF-8 bytes; 256 (``<sep>``) is the separator megatok puts before every document,
the tokenizer's bos and eos; 257 (``<pad>``) is padding. ``tokenizer(text).input_ids`` is megatok's
document: ``[256, *text.encode()]``. A special token's spelling inside a text is read as its bytes."""

from transformers import AddedToken, PreTrainedTokenizer


class MegatokByteTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, sep_token="<sep>", pad_token="<pad>", **kwargs):
        sep = AddedToken(sep_token, special=True) if isinstance(sep_token, str) else sep_token
        pad = AddedToken(pad_token, special=True) if isinstance(pad_token, str) else pad_token
        self._added_tokens_decoder = {256: sep, 257: pad}
        kwargs.update(bos_token=sep, eos_token=sep, sep_token=sep, pad_token=pad)
        kwargs.setdefault("split_special_tokens", True)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return 256

    def get_vocab(self):
        vocab = {chr(i): i for i in range(256)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text, **kwargs):
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token):
        return ord(token) if len(token) == 1 and ord(token) < 256 else None

    def _convert_id_to_token(self, index):
        return chr(index)

    def convert_tokens_to_string(self, tokens):
        data = bytearray()
        for token in tokens:  # (decode(..., skip_special_tokens=True) leaves out <sep> and <pad>)
            data += bytes([ord(token)]) if len(token) == 1 and ord(token) < 256 else token.encode("utf-8")
        return data.decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        ids = [256] + list(token_ids_0)
        return ids if token_ids_1 is None else ids + [256] + list(token_ids_1)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            return [int(i >= 256) for i in token_ids_0]
        mask = [1] + [0] * len(token_ids_0)
        return mask if token_ids_1 is None else mask + [1] + [0] * len(token_ids_1)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
