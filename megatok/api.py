"""The Python API: a trained model loaded in one line, to score, segment and continue text.

    import megatok
    model = megatok.load("runs/my-run")                  # a run (latest checkpoint, or checkpoint=TAG) or an export
    s = model.score("The quick brown fox")               # s.logprob, s.byte_logprobs, s.bits_per_byte
    model.segment("The quick brown fox")                 # the byte model's chunks (a BPE model's tokens)
    model.generate("def ", max_bytes=64, stop=["\\n\\n"]).text

Both model kinds: megatok's byte U-net and the BPE token model. Everything here is built on the evaluator
(megatok.eval.bpb.evaluate_documents: documents cut into windows of the run's ``data.seq_len``, every
byte predicted once) and on megatok.generate, so ``score(text).bits_per_byte`` is exactly the bits per
byte ``megatok-evaluate`` reports for that text under the same boundary rule. One exception:
``loglikelihood`` reads a continuation whose context fills more than a window in windows that end at it,
with as much of the context as fits (megatok-evaluate's windows would give it almost none).

Deterministic by default. A byte model's boundaries follow a rule fixed at load time: ``"threshold"``
(the default: a chunk starts where the strategy's boundary probability exceeds 0.5) or ``"sample"``
(drawn from the strategy, each window from its own seed derived from ``seed``, the text and the
window's place in it, as megatok-evaluate's ``--boundary sample --seed``). Every random draw comes
from a generator seeded for that call; the caller's global torch RNG state is left as it was. The
loaded module (``model.module``) keeps the rule as its ``boundary.eval_mode``.
"""

from __future__ import annotations

import codecs
import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatok.data.documents import Document
from megatok.data.encoding import encoding_for
from megatok.devices import checked_device
from megatok.eval.bpb import Seeded, boundary_rule, document_windows, evaluate_documents, window_seed
from megatok.boundaries.base import row_seeds
from megatok.generate import Generation, generate_batch as _generate_batch
from megatok.run.export import load_model_or_export

RULES = ("threshold", "sample")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def _as_bytes(text: str | bytes) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"expected str or bytes, got {type(text).__name__}")


@dataclass
class Score:
    """What the model thinks of a text. Log-probabilities are natural logs.

    ``logprob``: the text's total, summed as megatok-evaluate sums it, so ``bits_per_byte`` is its
    figure exactly. ``byte_logprobs[i]``: the byte model's log p of byte i given the bytes before it
    (in its window); they add up to ``logprob`` up to float32 rounding. For the BPE token model, a
    token's log-probability is put on its last byte (0 on its other bytes), so a sum over any run of
    whole tokens is that run's log-probability; ``tokens`` and ``token_logprobs`` give them per token."""

    text: bytes
    logprob: float
    byte_logprobs: list[float]
    boundary_rule: str | None  # None for the token model
    tokens: list[bytes] | None = None
    token_logprobs: list[float] | None = None

    @property
    def bytes(self) -> int:
        return len(self.text)

    @property
    def bits_per_byte(self) -> float:
        return -self.logprob / len(self.text) / math.log(2)


@dataclass
class Completion:
    """A continuation of a prompt. ``text``/``data``: the generated text (decoded as UTF-8, an invalid
    byte as U+FFFD / exactly), cut before the stop string that ended it. ``finish_reason``: "stop" (a
    stop string), "separator" (the model ended the document) or "length" (``max_bytes``). When
    ``max_bytes`` cut a character, its first bytes are left out of ``text`` (``data`` keeps them).
    ``generation``: everything megatok.generate returned (the ids, their log-probabilities, the byte
    model's chunk starts), uncut."""

    text: str
    data: bytes
    finish_reason: str
    stop: str | bytes | None
    generation: Generation = field(repr=False)


@dataclass
class _Pass:
    """One document's scoring pass: per target (byte, or token) its log p, whether it was the argmax,
    and (byte model) the chunk start decided at each input position."""

    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    starts: list[bool] = field(default_factory=list)
    nll: float = 0.0  # the evaluator's NLL sums of the document's windows, added in its order


class Model:
    """A loaded model (see :func:`load`). ``module`` is the torch module (eval mode), ``config`` the run's
    config, ``kind`` "unet" (the byte model) or "bpe" (the token model)."""

    def __init__(self, module, config, *, source: str, checkpoint: str | None, device, boundary: str, seed: int,
                 batch_size: int):
        if boundary not in RULES:
            raise ValueError(f"boundary must be one of {', '.join(RULES)}, got {boundary!r}")
        self.module, self.config, self.source, self.checkpoint = module, config, source, checkpoint
        self.kind = config.model.kind
        self.encoding = encoding_for(config)
        self.seq_len = config.data.seq_len
        self.device = torch.device(device)
        self.boundary, self.seed, self.batch_size = boundary, seed, batch_size
        if self.byte_model:
            module.boundary.eval_mode = boundary

    @property
    def byte_model(self) -> bool:
        return self.kind != "bpe"

    @property
    def boundary_rule(self) -> str | None:
        return boundary_rule(self.boundary, self.seed) if self.byte_model else None

    def __repr__(self) -> str:
        tag = f", checkpoint={self.checkpoint}" if self.checkpoint else ""
        rule = f", boundary={self.boundary_rule}" if self.byte_model else ""
        dtype = next(self.module.parameters()).dtype
        return f"megatok.Model({self.source!r}{tag}, kind={self.kind}{rule}, {dtype}, {self.device})"

    # -------------------------------------------------------------------------------------- passes

    def _passes(self, texts: list[bytes], windows: list[list[tuple[torch.Tensor, int]]] | None = None
                ) -> tuple[list[_Pass], dict]:
        """Score documents through evaluate_documents (batched, seeded as megatok-evaluate): each one's
        per-target log-probabilities, argmax flags and chunk starts, and the evaluator's figures.
        ``windows``: per document, its windows (ids, separator first in a document's first window) and how
        many of each window's last targets to keep, instead of megatok-evaluate's windows (all kept)."""
        read: dict[tuple[int, int], _Pass] = {}  # (document, window) -> what that window gave

        def keep(doc_no, i, w, out, row):
            n = len(w) - 1
            lo = 0 if windows is None else n - windows[doc_no][i][1]  # the targets before lo are context
            p = read[doc_no, i] = _Pass()
            p.logprobs = (-out.ce_full[row, lo:n].double()).tolist()
            p.nll = float(out.rows["nll"][row])
            p.greedy = (out.logits[row, lo:n].argmax(-1).cpu() == w[lo + 1:]).tolist()
            if out.boundaries is not None:
                p.starts = out.boundaries.starts[row, lo:n].tolist()

        given = None if windows is None else (lambda doc_no, _text: [w for w, _ in windows[doc_no]])
        docs = (Document(text=t, lang=None, domain=None, source="") for t in texts)
        figures = evaluate_documents(self.module, docs, seq_len=self.seq_len, batch_size=self.batch_size,
                                     mode=self.boundary, seed=self.seed, device=self.device, encoding=self.encoding,
                                     per_window=keep, windows=given)
        passes = [_Pass() for _ in texts]
        for (doc_no, _), part in sorted(read.items()):  # each document's windows in order
            p = passes[doc_no]
            p.logprobs += part.logprobs
            p.greedy += part.greedy
            p.starts += part.starts
            p.nll += part.nll
        return passes, figures

    def _ending_windows(self, ids: torch.Tensor, n: int) -> list[tuple[torch.Tensor, int]]:
        """Windows that read the last ``n`` targets of ``ids`` (a document, separator first) with as much
        of the ids before them as fits: the targets in groups of at most seq_len, aligned at the end (the
        first group, the shortest, gets the most context), each group read in the seq_len + 1 ids ending
        at its last target (the oldest dropped first, as the harness's ``hf`` model does). Ids that fit
        in one window give megatok-evaluate's one window: the document."""
        last = len(ids) - 1  # the index of the last target
        out = []
        for end in range(last, last - n, -self.seq_len):
            out.append((ids[max(0, end - self.seq_len):end + 1], min(self.seq_len, end - (last - n))))
        return out[::-1]

    # -------------------------------------------------------------------------------------- public

    def score(self, text: str | bytes) -> Score:
        """Log-probabilities of ``text`` read as a document (after the separator the model puts before
        every document), window by window as megatok-evaluate reads it."""
        return self.score_many([text])[0]

    def score_many(self, texts: list[str | bytes]) -> list[Score]:
        """:meth:`score` of several texts, batched (each scored as it would be alone)."""
        data = [_as_bytes(t) for t in texts]
        empty = [i for i, t in enumerate(data) if not t]
        if empty:
            which = "the text" if len(data) == 1 else f"text {empty[0]} of {len(data)}"
            raise ValueError(f"score: {which} is empty: there is no byte to score")
        passes, _ = self._passes(data)
        out = []
        for text, p in zip(data, passes):
            if self.byte_model:
                out.append(Score(text, -p.nll, p.logprobs, self.boundary_rule))
                continue
            ids = self.encoding.doc_ids(text)[1:].tolist()
            pieces = self.encoding.pieces()
            per_byte: list[float] = []
            for i, lp in zip(ids, p.logprobs):
                per_byte.extend([0.0] * (len(pieces[i]) - 1) + [lp])
            out.append(Score(text, -p.nll, per_byte, None, [pieces[i] for i in ids], p.logprobs))
        return out

    def segment(self, text: str | bytes) -> list[bytes]:
        """The text cut into the byte model's chunks, as its scoring pass chunks it (each window of
        ``seq_len`` bytes starts a chunk); the BPE token model's tokens. The pieces join to the text."""
        data = _as_bytes(text)
        if not data:
            return []
        if not self.byte_model:
            pieces = self.encoding.pieces()
            return [pieces[i] for i in self.encoding.doc_ids(data)[1:].tolist()]
        (p,), _ = self._passes([data])
        starts = p.starts[1:] + [self._last_start(data)]  # input 0 is the separator; the last byte is no input
        chunks, begin = [], 0
        for i in range(1, len(data)):
            if starts[i]:
                chunks.append(data[begin:i])
                begin = i
        chunks.append(data[begin:])
        return chunks

    @torch.no_grad()
    def _last_start(self, data: bytes) -> bool:
        """Whether the text's last byte starts a chunk. The scoring pass predicts that byte but never
        reads it; read here with the last window one byte longer, under that window's seed (a full
        last window: the byte starts a new one, and a chunk)."""
        windows = document_windows(data, self.seq_len, self.encoding)
        last = windows[-1]
        if len(last) - 1 == self.seq_len:
            return True
        seeds = row_seeds([window_seed(self.seed, data, len(windows) - 1)]) if self.boundary == "sample" else None
        with Seeded(self.seed), seeds if seeds is not None else contextlib.nullcontext():
            out = self.module(last[None].to(self.device))
        return bool(out.boundaries.starts[0, -1])

    def loglikelihood(self, context: str | bytes, continuation: str | bytes) -> tuple[float, bool]:
        """log p(continuation | context) and whether every byte (token) of it is the model's argmax."""
        return self.loglikelihoods([(context, continuation)])[0]

    def loglikelihoods(self, pairs: list[tuple[str | bytes, str | bytes]]) -> list[tuple[float, bool]]:
        """:meth:`loglikelihood` of many (context, continuation) pairs, batched. The byte model reads
        context + continuation as one document; the BPE model tokenizes the two apart (a token never
        spans the join) and reads the ids as one document. A document longer than ``seq_len`` is not cut
        as megatok-evaluate cuts it: the continuation is read in windows that end at it, filled on the
        left with as much of the context as fits (the oldest dropped first; a byte model's boundaries
        decided over each such window, seeded by its place among them)."""
        ctxs, conts = [_as_bytes(c) for c, _ in pairs], [_as_bytes(x) for _, x in pairs]
        texts, windows = [c + x for c, x in zip(ctxs, conts)], []
        for c, x in zip(ctxs, conts):
            if self.byte_model:
                ids, n = self.encoding.doc_ids(c + x), len(x)
            else:
                cont = self.encoding.doc_ids(x)[1:]
                ids, n = self.encoding.doc_ids(c).tolist() + cont.tolist(), len(cont)
            windows.append(self._ending_windows(torch.as_tensor(ids, dtype=torch.long), n))
        passes, _ = self._passes(texts, windows)  # each pass keeps the continuation's targets only
        return [(math.fsum(p.logprobs), all(p.greedy)) for p in passes]

    def generate(self, prompt: str | bytes | list, max_bytes: int = 200, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, stop=None, seed: int | list[int] | None = None,
                 cache: bool = True, batch_size: int | None = None, static: bool = False, cuda_graph: bool = False,
                 compile: bool = False):
        """Continue ``prompt`` (read as the start of a document) for up to ``max_bytes`` bytes (a BPE
        model's last token may run past), until the model ends the document or the text holds one of
        the ``stop`` strings (str or bytes; the completion is cut before it; an empty one is ignored, as
        megatok.generate and lm-eval's cut of a generation ignore it). ``temperature`` 0 is
        greedy; ``top_k``/``top_p`` restrict the sampled ids. A list of prompts gives a list of
        completions, decoded together in batches of ``batch_size`` (default: the model's), prompt i
        sampled with seed ``seed + i`` (or ``seed[i]``; ``seed`` defaults to the model's): each is the
        completion it gets alone. Byte-model boundaries follow the model's rule (decided as each byte
        arrives). ``static``: every step with fixed shapes and no host sync (the batch keeps its rows to
        the end); ``cuda_graph`` (the model on a GPU): that step captured once as a CUDA graph and replayed,
        one launch a step instead of one a kernel; ``compile``: that step through torch.compile (CPU or
        GPU; the first call for a batch size compiles, seconds to a minute). All give the same completions
        (up to float rounding)."""
        one = not isinstance(prompt, (list, tuple))
        prompts = [prompt] if one else list(prompt)
        if isinstance(seed, (list, tuple)):
            seeds = list(seed)
        else:
            seeds = [(self.seed if seed is None else seed) + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if isinstance(stop, (str, bytes)):
            stop = [stop]
        stops = [s for s in stop or [] if len(s)]  # b"" is in every text: it would cut at 0
        encoded = [_as_bytes(s) for s in stops]
        data = [_as_bytes(p) for p in prompts]
        size = max(1, batch_size or self.batch_size)
        gens = []
        for lo in range(0, len(data), size):
            gens += _generate_batch(self.module, data[lo:lo + size], seq_len=self.seq_len, max_bytes=max_bytes,
                                    temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds[lo:lo + size],
                                    boundary_mode=self.boundary, encoding=self.encoding, cache=cache, stop=encoded,
                                    static=static, cuda_graph=cuda_graph, compile=compile)
        out = [_completion(g, stops, encoded) for g in gens]
        return out[0] if one else out


def _completion(g: Generation, stops: list, encoded: list[bytes]) -> Completion:
    """A Generation as a Completion: cut before the stop string that ended it, decoded."""
    data, reason, which = g.text, "separator" if g.stopped else "length", None
    if g.stop is not None:
        cut = min((data.find(s), i) for i, s in enumerate(encoded) if s in data)
        data, which, reason = data[:cut[0]], stops[cut[1]], "stop"
    text = data.decode("utf-8", "replace")
    if reason == "length":  # max_bytes may stop inside a character: a decoder that is not told the
        # text ended holds its first bytes back (other invalid bytes still read as U+FFFD)
        text = codecs.getincrementaldecoder("utf-8")("replace").decode(data)
    return Completion(text, data, reason, which, g)


def load(path: str | Path, checkpoint: str | None = None, device: str | torch.device | None = None,
         dtype: torch.dtype | str | None = None, boundary: str = "threshold", seed: int = 0,
         batch_size: int = 8) -> Model:
    """A trained model from a run directory (its ``latest`` checkpoint, or ``checkpoint``, a tag such as
    "step00000300"; any ZeRO stage and world size) or from an export directory (megatok-export).

    ``device``: "cpu", "cuda" or "cuda:N" (default CUDA when available, else CPU); one this torch cannot use
    is a ValueError that says why. ``dtype``: torch.float32 (default),
    torch.bfloat16, ... or "fp32", "bf16", "fp16"; the weights are loaded into it one tensor at a time.
    ``boundary``/``seed``: the byte model's boundary rule, "threshold" (default: p > 0.5) or "sample"
    (seeded by ``seed``). ``batch_size``: windows per forward when scoring."""
    path = Path(path)
    device = checked_device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or a torch.dtype, got {dtype!r}")
        dtype = DTYPES[dtype]
    module, cfg, tag = load_model_or_export(path, checkpoint, device, dtype)
    return Model(module, cfg, source=str(path), checkpoint=tag, device=device, boundary=boundary, seed=seed,
                 batch_size=batch_size)
