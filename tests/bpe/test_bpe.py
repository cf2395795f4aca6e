"""megatok.bpe: the exact byte round trip, bytes per token, the contract checks, training."""

from __future__ import annotations

import io
import random

import pytest
import sentencepiece as spm

from megatok import bpe
from megatok.data.documents import Document

INVALID_UTF8 = [
    b"\x80", b"\xbf\x80", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xf0\x9f\x98", b"\xff", b"\xfe\xff",
    b"\xc0\xaf",                  # overlong "/"
    b"\xed\xa0\x80\xed\xb0\x80",  # UTF-8-encoded surrogates (what "surrogatepass" writes)
    b"\xf4\x90\x80\x80",          # above U+10FFFF
    b"abc\xffdef\x80 \xe6\x97",   # mixed with text, truncated at the end
]
TEXTS = [
    "", " ", "  leading and trailing  ", "a\tb\r\nc\n\n\n    indented\f\v", "\x00\x01\x1b[0m",
    "日本語のテキスト、人人生而自由。", "한국어 텍스트", "Всё ёжик", "नमस्ते दुनिया", "مرحبا بالعالم",
    "emoji 😀👍🏽👨‍👩‍👧 🇫🇷", "combining e\u0301 vs \u00e9, ligature \ufb01, full-width \uff21, NBSP\u00a0x",
    "sentencepiece's own space \u2581 and \u2581\u2581word\u2581", "\ufeffBOM and U+FFFD \ufffd",
    "def f(x):\n    return x + 1  # café\n",
]


def roundtrip(sp, data: bytes) -> list[int]:
    ids = bpe.encode_bytes(sp, data)
    assert bpe.decode_ids(sp, ids) == data
    assert sum(bpe.token_byte_lengths(sp, ids)) == len(data)
    table = bpe.token_bytes(sp)
    for start, i in zip(bpe.token_starts(sp, ids), ids):  # every token spells its own slice of the input
        assert data[start:start + len(table[i])] == table[i]
    return ids


def test_roundtrip_text_and_invalid_utf8(tokenizer):
    sp, _ = tokenizer
    for text in TEXTS:
        roundtrip(sp, text.encode("utf-8"))
    for data in INVALID_UTF8:
        ids = roundtrip(sp, data)
        assert all(sp.is_byte(i) for i in bpe.encode_bytes(sp, data.strip(b"abcdef ")[:1]))
        assert len(ids) >= 1


def test_roundtrip_random_bytes(tokenizer):
    sp, _ = tokenizer
    rng = random.Random(1234)
    for n in [1, 2, 3, 7, 64, 1000, 5000]:
        for _ in range(20):
            roundtrip(sp, bytes(rng.randrange(256) for _ in range(n)))
    # random mixtures of text pieces and junk bytes
    for _ in range(200):
        parts = [rng.choice(TEXTS).encode() if rng.random() < 0.6 else rng.choice(INVALID_UTF8) for _ in range(5)]
        roundtrip(sp, b"".join(parts))
    # every single byte value, and every byte pair with a high byte
    for b in range(256):
        roundtrip(sp, bytes([b]))
        roundtrip(sp, bytes([b, 0x80]) + bytes([0xC3, b]))


def test_roundtrip_every_unicode_plane_sample(tokenizer):
    sp, _ = tokenizer
    chars = [chr(c) for c in range(0, 0x110000, 97) if not 0xD800 <= c < 0xE000]
    roundtrip(sp, "".join(chars).encode("utf-8"))
    roundtrip(sp, " x ".join(chars[:3000]).encode("utf-8"))


def test_encode_batch_equals_one_by_one(tokenizer):
    sp, _ = tokenizer
    datas = [t.encode() for t in TEXTS] + INVALID_UTF8
    assert bpe.encode_batch(sp, datas) == [bpe.encode_bytes(sp, d) for d in datas]


def test_learned_pieces_are_used(tokenizer):
    sp, texts = tokenizer
    ids = roundtrip(sp, texts[0])
    assert len(ids) < 0.6 * len(texts[0])  # real merges, not bytes
    # invalid bytes and U+2581 always go to byte pieces; their neighbours are still merged normally
    ids = bpe.encode_bytes(sp, b"return\xffreturn")
    assert [bpe.decode_ids(sp, [i]) for i in ids].count(b"\xff") == 1
    assert sp.is_byte(ids[[bpe.decode_ids(sp, [i]) for i in ids].index(b"\xff")])
    assert [sp.id_to_piece(i) for i in bpe.encode_bytes(sp, "\u2581".encode())] == ["<0xE2>", "<0x96>", "<0x81>"]


def test_bytes_per_token_hand_example(tokenizer):
    sp, _ = tokenizer
    word = next(p for p in ("return", "self", "def") if sp.piece_to_id(p) != sp.unk_id())
    assert bpe.encode_bytes(sp, word.encode()) == [sp.piece_to_id(word)]  # one piece
    rare = "\U0001F99C"  # parrot emoji: not in the vocabulary, 4 byte-fallback tokens
    assert sp.piece_to_id(rare) == sp.unk_id()
    docs = [
        Document(word.encode(), "en", "code", "a"),            # len(word) bytes, 1 token
        Document(rare.encode(), "xx", "prose", "b"),           # 4 bytes, 4 tokens
        Document(b"\xff\xfe\x80", "xx", "prose", "c"),         # 3 bytes, 3 tokens
        Document("\u2581".encode(), "en", "prose", "d"),       # 3 bytes, 3 tokens
    ]
    r = bpe.bytes_per_token(sp, docs, batch=2)
    n = len(word)
    assert (r["documents"], r["bytes"], r["tokens"]) == (4, n + 10, 11)
    assert r["bytes_per_token"] == pytest.approx((n + 10) / 11)
    assert r["by_lang"]["en"] == {"documents": 2, "bytes": n + 3, "tokens": 4, "bytes_per_token": (n + 3) / 4}
    assert r["by_lang"]["xx"] == {"documents": 2, "bytes": 7, "tokens": 7, "bytes_per_token": 1.0}
    assert r["by_domain"]["prose"] == {"documents": 3, "bytes": 10, "tokens": 10, "bytes_per_token": 1.0}
    # plain bytes (no metadata): no breakdown
    r = bpe.bytes_per_token(sp, [d.text for d in docs])
    assert r["tokens"] == 11 and "by_lang" not in r
    assert bpe.disparity({"a": 2.0, "b": 4.0, "c": float("nan")}) == 2.0
    assert bpe.disparity({"a": 2.0}) != bpe.disparity({"a": 2.0})  # NaN: fewer than two languages


def _train_raw(sentences, **opts) -> spm.SentencePieceProcessor:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=buf, model_type="bpe",
                                   vocab_size=300, hard_vocab_limit=False, minloglevel=2, **opts)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def test_contract_violations_are_refused(tmp_path):
    sentences = ["hello world, the cat sat on the mat"] * 50
    with pytest.raises(bpe.TokenizerError, match="byte-fallback"):
        bpe.check_tokenizer(_train_raw(sentences))  # no byte fallback
    with pytest.raises(bpe.TokenizerError, match="round-trip"):
        bpe.check_tokenizer(_train_raw(sentences, byte_fallback=True))  # NFKC and a dummy prefix
    with pytest.raises(bpe.TokenizerError, match="round-trip"):
        bpe.check_tokenizer(_train_raw(sentences, byte_fallback=True, normalization_rule_name="identity",
                                       remove_extra_whitespaces=False))  # a dummy prefix only
    with pytest.raises(ValueError, match="contract"):
        bpe.train_bpe([b"x"], tmp_path, 300, add_dummy_prefix=True)
    with pytest.raises(FileNotFoundError):
        bpe.load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(bpe.TokenizerError):
        bpe.load_tokenizer(tmp_path / "junk.model")


def test_train_bpe_max_bytes_and_small_corpus(tmp_path):
    docs = [b"the cat sat on the mat. " * 20] * 10
    info = bpe.train_bpe(docs, tmp_path / "m.model", 2000, max_bytes=1000)
    assert info["documents"] == 3  # stops after the document that reaches the cap
    assert info["vocab_size"] < 2000 and info["requested_vocab_size"] == 2000  # the text supports fewer
    sp = bpe.load_tokenizer(tmp_path / "m.model")
    assert bpe.decode_ids(sp, bpe.encode_bytes(sp, docs[0])) == docs[0]
    with pytest.raises(ValueError, match="at least 260"):
        bpe.train_bpe(docs, tmp_path, 100)


def test_training_sentences_cover_text_runs():
    text = ("line one\n" * 1000 + "x" * 10_000 + "\n\u2581tail\xff").encode("utf-8", "surrogateescape")
    text = text.replace("\xff".encode(), b"\xff")
    pieces = list(bpe.training_sentences(text, max_bytes=4096))
    assert all(len(p.encode()) <= 4096 for p in pieces)
    assert "".join(pieces) == ("line one\n" * 1000 + "x" * 10_000 + "\n" + "tail")
    assert all("\u2581" not in p for p in pieces)
