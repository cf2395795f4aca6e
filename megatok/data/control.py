"""The positive control: generated text in which a chunk start at a known class of positions (the
whitespace before each word) is worth a set amount (``megatok-make-corpus --preset control --level Q``).

Text is words separated by one whitespace byte. A word is a key letter (one of ``keys``, at random), the
filler "ao" and an ending: "", "e", "er" or "ers". The separator after a word is a space, a tab, a newline
or a carriage return, at random, and it carries a message: with probability ``level`` the next word's
ending is the one a fixed random pairing (drawn from the seed) gives that separator; otherwise the ending
is drawn uniformly. Every draw is uniform, so the text's letters, lengths and rates are the same at every
level; only how much the separator tells about the next ending changes.

Why a chunk start at the separator is worth something, and a start elsewhere nothing, for the control's
model (configs/replication/control.json): its byte layers see one byte (``model.byte_window`` 1), so what
the separator was is known at the separator and nowhere else in the byte layers; the main network sees the
byte state of each chunk's start, so it learns which separator came only from a chunk that starts exactly
there. The ending it tells comes three or more bytes later (after the key and the filler): the byte layers
cannot carry it there, the main network can (its output reaches every byte of the chunk, and later chunks
attend to earlier ones). So at ``level`` 1 a start at the separator saves up to the ending's 2 bits, three to
six bytes later (what discounted returns credit it with); a start anywhere else learns nothing the byte
layers did not have. At ``level`` 0 the separator tells nothing, and no start is worth anything. The
positions that pay are exactly the ones megatok.stats.space_before_word marks (ASCII whitespace before a
word), so the training rows' and evaluations' ``sbw_boundary_fraction`` is the fraction of them a model
starts a chunk at (``megatok-boundary-value`` measures the value of each class of positions).

The harder variant (``signal`` 1, ``megatok-make-corpus --preset control --signal 1``): only the space carries
the message; after a tab, a newline or a carriage return the next ending is drawn uniformly. A start pays at
the spaces before words alone (a quarter of the separators, about 0.045 of the bytes), so a policy must tell
the space from the other separators, which look alike to its rate term; the figure that counts is
``space_boundary_fraction`` (megatok.stats: the spaces, 0x20, before words that start a chunk).

Everything is drawn from ``random.Random(seed)``: the same seed and sizes give the same pairing and text,
byte for byte. Held-out documents are a later stretch of the same process.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KEY_LETTERS = "bcdfghijklmnpqtuvwxyz"  # every letter but the filler's (a, o) and the endings' (e, r, s)
FILLER = "ao"
ENDINGS = ("", "e", "er", "ers")
SEPARATORS = (" ", "\t", "\n", "\r")  # ASCII whitespace, as space_before_word counts it


@dataclass(frozen=True)
class Control:
    level: float
    seed: int = 0
    keys: int = 8
    doc_words: tuple[int, int] = (150, 450)  # words per document, drawn uniformly
    #: how many of the four separators carry the message (the first ``signal`` of SEPARATORS: 1 is the space
    #: alone); after the others the next ending is always drawn uniformly
    signal: int = 4

    def __post_init__(self):
        if not 0 <= self.level <= 1:
            raise ValueError(f"level {self.level} is not in [0, 1]")
        if not 1 <= self.keys <= len(KEY_LETTERS):
            raise ValueError(f"keys {self.keys}: need 1 to {len(KEY_LETTERS)}")
        if not 1 <= self.signal <= len(SEPARATORS):
            raise ValueError(f"signal {self.signal}: need 1 to {len(SEPARATORS)} separators")


class Generator:
    """Documents of one control corpus, in order; ``documents(n_bytes)`` continues where the last call
    stopped (training documents first, then held-out ones)."""

    def __init__(self, spec: Control):
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.keys = self.rng.sample(KEY_LETTERS, spec.keys)
        #: the ending each separator announces
        self.pairing = dict(zip(SEPARATORS, self.rng.sample(ENDINGS, len(ENDINGS))))

    def document(self) -> str:
        rng, spec = self.rng, self.spec
        out = []
        ending = rng.choice(ENDINGS)
        for i in range(rng.randint(*spec.doc_words)):
            out.append(rng.choice(self.keys) + FILLER + ending)
            sep = rng.choice(SEPARATORS)
            follows = rng.random() < spec.level and sep in SEPARATORS[:spec.signal]
            ending = self.pairing[sep] if follows else rng.choice(ENDINGS)
            out.append(sep)
        return "".join(out[:-1])  # no separator after the last word

    def documents(self, n_bytes: int, name: str = "control") -> list[dict]:
        """Whole documents, at least ``n_bytes`` in all."""
        docs, have = [], 0
        while have < n_bytes:
            text = self.document()
            have += len(text)
            docs.append({"text": text, "lang": "und", "domain": "control",
                         "source": f"{name}/level{self.spec.level:g}-seed{self.spec.seed}"
                                   f"{'' if self.spec.signal == 4 else f'-signal{self.spec.signal}'}#{len(docs)}"})
        return docs


def ending_bits(level: float) -> dict[str, float]:
    """Bits per word of a word's ending for a model that knows the separator before it (``given_separator``)
    and one that does not (``without``): their difference is what a chunk start at the separator can save
    (in bits, at most, for a model that learned the pairing)."""
    n = len(ENDINGS)
    p_hit = level + (1 - level) / n
    rest = (1 - level) / n
    given = -p_hit * math.log2(p_hit) - (n - 1) * (rest * math.log2(rest) if rest > 0 else 0.0)
    return {"given_separator": max(0.0, given), "without": math.log2(n)}
