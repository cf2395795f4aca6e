"""Per-sequence sums that every report is built from: bits per byte, chunk counts, boundary quality.

Sums (never means) so they add up over micro-batches, documents and ranks; :func:`ratios` turns a
total into the reported figures only at the end.
"""

from __future__ import annotations

import math

import torch

from megatok.vocab import PAD, VOCAB_SIZE

#: Bytes that separate words: ASCII whitespace (tab, LF, VT, FF, CR, space) and ASCII punctuation
#: (Python's string.punctuation: !"#$%&'()*+,-./:;<=>?@[\]^_`{|}~).
SEPARATOR_BYTES = frozenset(b"\t\n\x0b\x0c\r !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def word_byte_table() -> torch.Tensor:
    """bool [VOCAB_SIZE]: True for ids that belong to a word: every byte except the separators
    above, so letters, digits and every byte >= 0x80 (multi-byte UTF-8 characters are word
    characters); False for the separators and the specials (SEP, PAD)."""
    table = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    table[:256] = True
    table[list(SEPARATOR_BYTES)] = False
    return table


_WORD_BYTES: dict = {}


def word_bytes(x: torch.Tensor) -> torch.Tensor:
    """bool, like ``x``: :func:`word_byte_table` at each id, looked up in the table (cached per device); inside
    compiled code computed from the separators' byte ranges instead (a cache filled while tracing would make
    the next call recompile)."""
    if torch.compiler.is_compiling():
        def within(lo, hi):
            return (x >= lo) & (x <= hi)

        separator = within(9, 13) | within(32, 47) | within(58, 64) | within(91, 96) | within(123, 126)
        return (x < 256) & ~separator
    if x.device not in _WORD_BYTES:
        _WORD_BYTES[x.device] = word_byte_table().to(x.device)
    return _WORD_BYTES[x.device][x]


def word_starts(x: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: position t >= 1 starts a word when x_t is a word byte and x_{t-1} is not
    (a separator, SEP or PAD). Position 0 is never counted: a packed window can begin mid-word and
    the boundary there is forced, not decided. A continuation byte (0x80-0xBF) follows its lead byte
    in valid UTF-8, so a word never starts inside a character."""
    word = word_bytes(x)
    out = torch.zeros_like(word)
    out[:, 1:] = word[:, 1:] & ~word[:, :-1]
    return out


def space_before_word(x: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: x_t is ASCII whitespace and x_{t+1} starts a word (t >= 1): where a chunk that
    starts with the space before a word would begin (sentencepiece style " word"). Indentation and
    runs of spaces count once, at the space right before the word."""
    words = word_starts(x)
    out = torch.zeros_like(words)
    ws = (x == 32) | ((x >= 9) & (x <= 13))
    out[:, 1:-1] = ws[:, 1:-1] & words[:, 2:]
    return out


def word_start_alignment(x: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(word starts [B, T], word starts hit [B, T], aligned boundaries [B, T]).

    Chunking conventions differ on where a word's chunk begins: at its first byte ("the| cat" ->
    "cat") or at the whitespace byte right before it (sentencepiece/GPT-2 style "the| cat" ->
    " cat"). Both count: a word start w is *hit* when a chunk starts at w, or at w - 1 >= 1 when
    x_{w-1} is ASCII whitespace (space, tab, LF, VT, FF, CR). A boundary at t >= 1 is *aligned* when
    t is a word start or such a whitespace byte right before one. Precision = aligned boundaries /
    all boundaries at t >= 1; recall = word starts hit / word starts.
    """
    words = word_starts(x)
    lead = space_before_word(x)  # whitespace byte right before a word start, at t >= 1
    hit = words.clone()
    hit[:, 1:] &= starts[:, 1:] | (lead[:, :-1] & starts[:, :-1])
    aligned = starts & (words | lead)
    aligned[:, 0] = False
    return words, hit, aligned


@torch.no_grad()
def row_stats(x: torch.Tensor, y: torch.Tensor, starts: torch.Tensor, ce_full: torch.Tensor,
              ce_early: torch.Tensor, probs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """float64 [B] per key: nll / nll_early (nats over byte targets: the SEP ids between packed
    documents are trained on but not counted, so bpb is over UTF-8 bytes only), targets, chunks
    (starts at real positions), positions (real inputs: inputs with a target), ws_positions /
    ws_boundaries (whitespace bytes, and those that start a chunk), decisions (chunk starts at t >= 1: the forced one at t = 0
    is no decision), word_starts, word_starts_hit and aligned_boundaries (see
    :func:`word_start_alignment`): precision = aligned_boundaries / decisions, recall =
    word_starts_hit / word_starts; sbw_positions / sbw_boundaries: spaces before a word
    (:func:`space_before_word`) and those that start a chunk; space_positions / space_boundaries: the same
    for the spaces (0x20) among them; wfb_positions / wfb_boundaries: the first
    bytes of the same words (the byte after each such space) and those that start a chunk. With
    ``probs`` (a strategy's boundary probabilities p_t), also p_sbw (p summed over spaces before a
    word) and p_other (over the other positions t >= 1), and other_positions: the earliest sign of a
    policy learning where words start."""
    # real: an input with a target. A padded row's last input (its target is PAD) is left out, as in an
    # unpadded row, which ends before it: the figures must not depend on the padding (the batch size).
    real, tmask = (x != PAD) & (y != PAD), y < 256
    ws = real & ((x == 9) | (x == 10) | (x == 13) | (x == 32))
    starts = starts & real
    words, hit, aligned = word_start_alignment(x, starts)
    free = starts.clone()
    free[:, 0] = False
    sbw = space_before_word(x) & real
    wfb = torch.zeros_like(sbw)
    wfb[:, 1:] = sbw[:, :-1]
    wfb &= real
    space = sbw & (x == 32)
    cols = {
        "nll": (ce_full * tmask).sum(1),
        "nll_early": (ce_early * tmask).sum(1),
        "targets": tmask.sum(1),
        "chunks": (starts & real).sum(1),
        "positions": real.sum(1),
        "ws_positions": ws.sum(1),
        "ws_boundaries": (ws & starts).sum(1),
        "decisions": free.sum(1),
        "word_starts": (words & real).sum(1),
        "word_starts_hit": (hit & real).sum(1),
        "aligned_boundaries": (aligned & real).sum(1),
        "sbw_positions": sbw.sum(1),
        "sbw_boundaries": (sbw & starts).sum(1),
        "space_positions": space.sum(1),
        "space_boundaries": (space & starts).sum(1),
        "wfb_positions": wfb.sum(1),
        "wfb_boundaries": (wfb & starts).sum(1),
    }
    if probs is not None:
        other = real.clone()
        other[:, 0] = False
        other &= ~sbw
        cols.update(p_sbw=(probs.float() * sbw).sum(1), p_other=(probs.float() * other).sum(1),
                    other_positions=other.sum(1))
    return {k: v.double() for k, v in cols.items()}


def ratios(s: dict[str, float]) -> dict[str, float]:
    """Reported figures from summed statistics (NaN where a denominator is zero). Boundary figures
    need boundary sums; ``bytes_per_token`` needs ``tokens`` (the BPE token model's statistics)."""
    def div(a, b):
        return float(a) / float(b) if float(b) else float("nan")

    out = {"bpb": div(s["nll"], s["targets"]) / math.log(2)}
    if "chunks" in s:
        out["bytes_per_chunk"] = div(s["positions"], s["chunks"])
        out["boundary_rate"] = div(s["chunks"], s["positions"])
        out["whitespace_boundary_fraction"] = div(s["ws_boundaries"], s["ws_positions"])
    if "dropped_starts" in s:  # model.pack_chunks
        out["dropped_start_fraction"] = div(s["dropped_starts"], s["chunks"] + s["dropped_starts"])
    if "tokens" in s:
        out["bytes_per_token"] = div(s["targets"], s["tokens"])
    if "word_starts" in s:
        out["word_start_precision"] = div(s["aligned_boundaries"], s["decisions"])
        out["word_start_recall"] = div(s["word_starts_hit"], s["word_starts"])
    if "sbw_positions" in s:
        out["sbw_boundary_fraction"] = div(s["sbw_boundaries"], s["sbw_positions"])
    if "space_positions" in s:  # the spaces (0x20) alone among them: the harder control's paying positions
        out["space_boundary_fraction"] = div(s["space_boundaries"], s["space_positions"])
    if "wfb_positions" in s:
        out["wfb_boundary_fraction"] = div(s["wfb_boundaries"], s["wfb_positions"])
    if "p_sbw" in s:
        out["p_sbw"] = div(s["p_sbw"], s["sbw_positions"])
        out["p_other"] = div(s["p_other"], s["other_positions"])
    if "score_sbw" in s:  # the policy's per-decision score-function terms (megatok.boundaries.policy)
        for cls, n in (("sbw", "sbw_decisions"), ("other", "other_decisions")):
            mean = div(s[f"score_{cls}"], s[n])
            var = div(s[f"score2_{cls}"], s[n]) - mean ** 2
            out[f"snr_{cls}"] = mean / math.sqrt(var) if var > 0 else float("nan")
            out[f"u_{cls}"] = mean
            for name, short in (("returns", "ret"), ("reward", "reward"), ("logits", "logit")):
                if f"{name}_{cls}_sum" in s:
                    out[f"{short}_{cls}"] = div(s[f"{name}_{cls}_sum"], s[n])
    if "nll_early" in s:
        out["bpb_early"] = div(s["nll_early"], s["targets"]) / math.log(2)
    return out
