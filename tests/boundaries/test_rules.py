"""Rule-based strategies against hand-checked strings: uniform (exact rate, causal draw), whitespace (never inside
a UTF-8 character), bpe (causal walk over the vocabulary; exact token starts, byte-fallback aware)."""

import pytest
import torch

from megatok.boundaries import build_strategy
from megatok.boundaries.bpe import build_trie, causal_starts, exact_starts, tokenizer_and_trie
from megatok.boundaries.uniform import uniform_starts
from megatok.boundaries import build_strategy
from megatok.boundaries.whitespace import whitespace_starts
from megatok.config import ConfigError, load_config
from megatok.vocab import PAD, SEP
from tests.boundaries.tokenizer import tiny_bpe_model
from tests.conftest import stdlib_texts


def segments(data: bytes, starts) -> list[bytes]:
    idx = [i for i, s in enumerate(starts) if s] + [len(data)]
    return [data[a:b] for a, b in zip(idx, idx[1:])]


def batch(*texts: bytes):
    width = max(len(t) for t in texts)
    x = torch.full((len(texts), width), PAD)
    for i, t in enumerate(texts):
        x[i, :len(t)] = torch.tensor(list(t))
    return x, x != PAD


# --------------------------------------------------------------------------- uniform


@pytest.mark.parametrize("rho", [0.1, 0.2, 0.25, 0.5, 0.9])
def test_uniform_hits_exactly_round_rho_times_the_window(rho):
    torch.manual_seed(0)
    mask = torch.ones(8, 512, dtype=torch.bool)
    for _ in range(5):
        s = uniform_starts(mask, rho)
        assert s[:, 0].all() and s.sum(1).tolist() == [round(rho * 512)] * 8
    a, b = uniform_starts(mask, rho), uniform_starts(mask, rho)
    assert not torch.equal(a, b)  # random positions


def test_uniform_draws_do_not_depend_on_length_width_forced_starts_or_bytes():
    """The draw depends on the generator and the training window only: a shorter (padded) row, a
    narrower or wider batch (up to the window), or a forced start (a SEP) later in the window, leaves
    every earlier decision as it was."""
    S, rho = 300, 0.2
    full = torch.ones(16, S, dtype=torch.bool)
    ref = uniform_starts(full, rho, torch.Generator().manual_seed(1), window=S)
    assert torch.equal(ref, uniform_starts(full, rho, torch.Generator().manual_seed(1)))  # window = T
    for L in (1, 7, 100, 299):
        padded = torch.arange(S)[None, :] < L
        for width in (L, 150, S):  # the batch's padded width: its widest row
            if width < L:
                continue
            mask = padded[:, :width].expand(16, width)
            s = uniform_starts(mask, rho, torch.Generator().manual_seed(1), window=S)
            assert torch.equal(s[:, :L], ref[:, :L]) and not s[:, L:].any(), (L, width)
    forced = torch.zeros(16, S, dtype=torch.bool)
    forced[:, [0, 250]] = True
    s = uniform_starts(full, rho, torch.Generator().manual_seed(1), forced=forced, window=S)
    assert torch.equal(s[:, :250], ref[:, :250]) and s[:, 250].all()
    # a row of L real bytes keeps t = 0 and each later byte with probability (k - 1) / (S - 1)
    k = round(rho * S)
    for width, L in ((60, 60), (150, 60), (150, 150)):
        mask = (torch.arange(width)[None, :] < L).expand(2000, width)
        s = uniform_starts(mask, rho, torch.Generator().manual_seed(2), window=S)
        assert s.float().sum(1).mean() == pytest.approx(1 + (L - 1) * (k - 1) / (S - 1), rel=0.02)


def test_uniform_strategy_rate_and_positions_are_spread():
    torch.manual_seed(0)
    strat = build_strategy("uniform", d_model=4, target_rate=0.2, options={})
    x = torch.randint(0, 256, (200, 100))
    b = strat(None, x, torch.ones_like(x, dtype=torch.bool))
    assert (b.starts.sum(1) == 20).all()
    per_position = b.starts[:, 1:].float().mean(0)  # 19 of 99 free positions each: ~0.19 everywhere
    assert per_position.min() > 0.08 and per_position.max() < 0.32


# --------------------------------------------------------------------------- whitespace


@pytest.mark.parametrize("text,want", [
    ("Hello, world!", ["Hello,", " ", "world!"]),
    ("a b\nc\td", ["a ", "b\n", "c\t", "d"]),
    ("naïve café", ["naïve ", "café"]),                     # 2-byte characters stay whole
    ("x—y z", ["x—y ", "z"]),                                # an em dash (3 bytes) is not ASCII punctuation
    ("日本語 テキスト", ["日本語 ", "テキスト"]),              # 3-byte characters
    ("emoji 😀! ok", ["emoji ", "😀!", " ", "ok"]),            # 4 bytes
    ("def f(x):\n        return x", ["def ", "f(", "x)", ":", "\n", "        ", "return ", "x"]),
    ("a  b", ["a  ", "b"]),                                  # a run of spaces is one separator
])
def test_whitespace_segments_hand_checked(text, want):
    data = text.encode()
    x, mask = batch(data)
    got = segments(data, whitespace_starts(x, mask)[0].tolist())
    assert [s.decode() for s in got] == want


@pytest.mark.parametrize("text,want", [
    ("Hello, world!", ["Hello", ",", " world", "!"]),
    ("a b\nc\td", ["a", " b", "\nc", "\td"]),
    ("naïve café", ["naïve", " café"]),
    ("def f(x):\n        return x", ["def", " f", "(x", ")", ":", "\n", "        return", " x"]),
    ("a  b", ["a", "  b"]),                                  # a run of spaces starts one chunk, at its first
])
def test_whitespace_at_the_separator_hand_checked(text, want):
    """position "at": the separator starts the chunk (the space before a word, not the word's first byte)."""
    data = text.encode()
    x, mask = batch(data)
    got = segments(data, whitespace_starts(x, mask, position="at")[0].tolist())
    assert [s.decode() for s in got] == want


def test_whitespace_position_from_the_config():
    from megatok.config import ConfigError, load_config

    cfg = load_config("configs/tiny.json", ["boundary.strategy=whitespace", "boundary.position=at"], world_size=1)
    strategy = build_strategy("whitespace", d_model=8, target_rate=0.2, options=cfg.boundary.options)
    x, mask = batch(b"one two")
    assert strategy(None, x, mask, None).starts[0].tolist() == [True, False, False, True, False, False, False]
    with pytest.raises(ConfigError, match="position"):
        load_config("configs/tiny.json", ["boundary.strategy=whitespace", "boundary.position=before"], world_size=1)


def test_whitespace_never_splits_a_character_even_after_a_separator():
    # invalid UTF-8: a continuation byte right after a space must still not start a chunk
    data = b"a \x80\xbf b"
    x, mask = batch(data)
    starts = whitespace_starts(x, mask)[0].tolist()
    assert starts == [True, False, False, False, False, True]
    # every continuation byte of real multi-byte text: never a start
    text = "Ünïcödé — 中文 😀 ".encode() * 3
    x, mask = batch(text)
    s = whitespace_starts(x, mask)[0]
    cont = (x[0] >= 0x80) & (x[0] < 0xC0)
    assert not (s & cont).any()


def test_whitespace_without_merging_runs_and_after_sep():
    data = [ord("a"), ord(" "), ord(" "), ord("b"), SEP, ord("c")]
    x = torch.tensor([data])
    mask = torch.ones_like(x, dtype=torch.bool)
    assert whitespace_starts(x, mask, merge_space_runs=False)[0].tolist() == [True, False, True, True, False, True]
    assert whitespace_starts(x, mask)[0].tolist() == [True, False, False, True, False, True]


# --------------------------------------------------------------------------- bpe


HAND_VOCAB = [b" the", b"caf", b"\xc3\xa9", b"re", b"ab", b"abcd"] + [bytes([i]) for i in range(256)]


@pytest.mark.parametrize("text,want", [
    (" the café", [" the", " ", "caf", "é"]),      # " c" is no piece's prefix; é (2 bytes) is a piece
    ("there", ["t", "h", "e", "re"]),              # "th" is no piece's prefix (only " th...")
    ("abcd abce", ["abcd", " ", "abc", "e"]),      # greedy: "abc" could still become "abcd", then "e" breaks it
    ("ü", ["\xfc".encode().decode()]),             # not a piece: byte fallback splits...
])
def test_bpe_causal_rule_on_a_hand_made_vocabulary(text, want):
    trie = build_trie(HAND_VOCAB)
    data = text.encode()
    got = segments(data, causal_starts(list(data), trie))
    if text == "ü":  # ...the two bytes of ü into two chunks, as the tokenizer's <0xC3><0xBC> would
        assert got == [b"\xc3", b"\xbc"]
    else:
        assert [s.decode() for s in got] == want


def test_bpe_causal_rule_restarts_after_sep():
    trie = build_trie(HAND_VOCAB)
    ids = list(b"ab") + [SEP] + list(b"cd")
    assert causal_starts(ids, trie) == [True, False, True, True, True]


def test_bpe_exact_rule_maps_sentencepiece_tokens_to_bytes():
    sp, _ = tokenizer_and_trie(tiny_bpe_model())
    for text in ["the self.x = 1", "naïve café über", "日本 and 😀", "  two  spaces\tand\ttabs\n"]:
        data = text.encode()
        # reference: lengths in bytes of the pieces sentencepiece returns, in order
        pieces = sp.encode(text, out_type=str)
        want, pos = [], 0
        for p in pieces:  # (megatok-train-bpe's tokenizers add no dummy-prefix space)
            n = 1 if (p.startswith("<0x") and p.endswith(">")) else len(p.replace("\u2581", " ").encode())
            if n:
                want.append(pos)
            pos += n
        assert pos == len(data), (text, pieces)
        got = [i for i, s in enumerate(exact_starts(list(data), sp)) if s]
        assert got == want, (text, pieces)


def test_bpe_exact_rule_splits_unknown_characters_into_bytes_and_handles_invalid_utf8():
    sp, _ = tokenizer_and_trie(tiny_bpe_model())
    data = "aé".encode()  # é is not in the stdlib-trained vocabulary: <0xC3> <0xA9>
    assert sp.encode("é", out_type=str)[-2:] == ["<0xC3>", "<0xA9>"]
    assert exact_starts(list(data), sp) == [True, True, True]
    assert exact_starts(list(b"ab\xffcd"), sp)[2] is True  # an invalid byte is its own chunk
    assert sum(exact_starts(list(b"ab\xffcd"), sp)) >= 3


def test_bpe_causal_rule_is_causal_and_exact_rule_is_not():
    """Causal: the starts of a prefix are the prefix of the starts. Exact: BPE merges look ahead."""
    sp, trie = tokenizer_and_trie(tiny_bpe_model())
    text = list(b"def singing(self, string):\n    return self.thing + other_things  # those there\n")
    full_c, full_e = causal_starts(text, trie), exact_starts(text, sp)
    leaks = 0
    for t in range(1, len(text)):
        assert causal_starts(text[:t], trie) == full_c[:t]
        leaks += exact_starts(text[:t], sp) != full_e[:t]
    assert leaks > 0
    # the causal walk finds most of sentencepiece's token starts on ordinary text
    both = sum(a and b for a, b in zip(full_c, full_e))
    assert both / sum(full_e) > 0.6


def test_bpe_strategy_and_its_options():
    path = tiny_bpe_model()
    strat = build_strategy("bpe", d_model=4, target_rate=0.2, options={"model_path": path})
    x, mask = batch(b"the self.x = 1", b"self")
    b = strat(None, x, mask)
    sp, trie = tokenizer_and_trie(path)
    assert b.starts[0].tolist() == causal_starts(list(b"the self.x = 1"), trie)
    assert b.starts[1, :4].tolist() == causal_starts(list(b"self"), trie) and not b.starts[1, 4:].any()
    with pytest.raises(ConfigError, match="boundary.model_path"):
        load_config(None, ["boundary.strategy=bpe"], world_size=1)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, ["boundary.strategy=bpe", "boundary.model_path=/nonexistent.model"], world_size=1)
    cfg = load_config(None, ["boundary.strategy=bpe", f"boundary.model_path={path}", "boundary.rule=exact"],
                      world_size=1)
    assert cfg.boundary.options.model_dump() == {"model_path": path, "rule": "exact"}


def test_checkpoints_name_the_bpe_strategys_tokenizer(tmp_path):
    """The tokenizer the bpe strategy reads is one of the files a checkpoint records by digest: a file
    replaced at the same path is named by its config key and path."""
    import shutil

    from megatok.run.checkpoints import CheckpointError
    from megatok.run.same_model import check_model_files, model_files

    path = tmp_path / "tok.model"
    shutil.copy(tiny_bpe_model(), path)
    cfg = load_config(None, ["boundary.strategy=bpe", f"boundary.model_path={path}"], world_size=1)
    recorded = model_files(cfg)
    assert list(recorded) == ["boundary.model_path"]
    assert model_files(load_config(None, [], world_size=1)) == {}  # the policy reads no file
    check_model_files({"model": {"model_files": recorded}}, tmp_path / "ckpt", cfg)
    with pytest.raises(CheckpointError, match=f"another boundary.model_path than {path} holds now"):
        check_model_files({"model": {"model_files": {"boundary.model_path": "0" * 16}}}, tmp_path / "ckpt", cfg)


def test_bpe_strategy_refuses_a_tokenizer_that_does_not_encode_bytes_exactly(tmp_path):
    """A tokenizer with sentencepiece's defaults (dummy prefix, NFKC) fails at config load, in one line."""
    import sentencepiece as spm

    lines = [line for text in stdlib_texts(n_files=5) for line in text.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "plain"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, minloglevel=2)
    with pytest.raises(ConfigError, match=r"boundary.model_path: .*does not round-trip text exactly"):
        load_config(None, ["boundary.strategy=bpe", f"boundary.model_path={tmp_path / 'plain.model'}"], world_size=1)
