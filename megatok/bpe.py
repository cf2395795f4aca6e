"""A sentencepiece BPE tokenizer over raw bytes: the baseline megatok is compared against.

Train one with ``megatok-train-bpe`` (or :func:`train_bpe`); use it with :func:`load_tokenizer`,
:func:`encode_bytes` and :func:`decode_ids`.

Encode/decode contract (bytes in, bytes out, exact for ANY bytes)
----------------------------------------------------------------
megatok reads bytes, sentencepiece reads text, so the two meet like this:

1. ``data`` is decoded as UTF-8 with ``surrogateescape``: every byte that is not part of valid UTF-8
   (stray continuation bytes, truncated sequences, encoded surrogates, ...) becomes one lone
   surrogate U+DC80..U+DCFF standing for exactly that byte.
2. The text is cut into runs. A run of ordinary characters is encoded by sentencepiece. Characters
   sentencepiece cannot carry faithfully go straight to the byte-fallback pieces ``<0xNN>``, one
   per byte: the escaped bytes of step 1, and U+2581 "\u2581" (sentencepiece's own whitespace
   symbol: a literal one in the input would otherwise decode as a space).
3. The tokenizer is trained with identity normalisation, no dummy prefix, no whitespace removal
   and byte fallback (:data:`SP_OPTIONS`), so sentencepiece keeps every character of a run and a
   character outside the vocabulary becomes the byte pieces of its UTF-8 encoding.

Every token therefore stands for a fixed byte string (:func:`token_bytes`): a byte piece for its
byte, a normal piece for its text with "\u2581" read as a space, control pieces (``<s>``, ``</s>``,
``<unk>``) for no bytes. Decoding is the concatenation of those byte strings, NOT ``sp.decode``
(which would turn invalid UTF-8 into U+FFFD). Hence, for every ``data``::

    decode_ids(sp, encode_bytes(sp, data)) == data
    sum(token_byte_lengths(sp, encode_bytes(sp, data))) == len(data)

and token t covers bytes [starts[t], starts[t] + len_t) of ``data`` (:func:`token_starts`), which is
what a chunking that must start chunks at token starts needs. :func:`load_tokenizer` refuses a model
that breaks the contract (NFKC normalisation, a dummy prefix, no byte pieces).

Documents are encoded independently (a document boundary is always a token boundary).

Bits per byte of a token model (how it is compared with megatok)
---------------------------------------------------------------
BPB = (sum of the token NLLs over the text, in nats) / (UTF-8 bytes of the text) / ln 2 (see
docs/method.md). The byte count is the text's, i.e. the sum of the byte lengths of
its tokens; a target token that stands for no bytes (``</s>`` used as a document separator) is left
out of both sums, as megatok leaves its SEP targets out (:func:`bpb_from_token_nll`).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from megatok.errors import ConfigError

#: sentencepiece trainer options that the encode/decode contract above relies on (do not change
#: them) plus the BPE defaults megatok uses. ``train_bpe(..., **options)`` may override the latter.
SP_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,                   # every byte has a piece: nothing is ever <unk>
    normalization_rule_name="identity",   # no NFKC: the pieces are the input's exact characters
    remove_extra_whitespaces=False,       # keep runs of spaces (code indentation), leading/trailing ones
    add_dummy_prefix=False,               # no invented leading space: token bytes add up to the input
    allow_whitespace_only_pieces=True,    # "    " can be one piece
    split_digits=False,
    character_coverage=0.99995,           # characters that must be pieces; rarer ones fall back to bytes.
                                          # 0.9995 (sentencepiece's default) leaves most CJK characters as
                                          # 3 byte tokens when the text is mostly English (zh: 1.2 bytes/token)
    hard_vocab_limit=False,               # a small corpus yields a smaller vocabulary instead of an error
    max_sentence_length=1 << 16,
    num_threads=2,
    minloglevel=2,
)
CONTRACT_OPTIONS = ("model_type", "byte_fallback", "normalization_rule_name", "remove_extra_whitespaces",
                    "add_dummy_prefix")

#: Characters routed around sentencepiece to the byte pieces: escaped invalid bytes and U+2581.
_RAW = re.compile("([\udc80-\udcff\u2581]+)")
#: Training text is fed to sentencepiece in pieces of at most this many bytes, cut after a newline.
SENTENCE_BYTES = 4096
#: A probe the contract must survive: NFKC would change the ligature and the full-width letter, a
#: dummy prefix would add a space, whitespace removal would drop some.
_PROBE = "ﬁ Ａ  x\t\n y ▁ é日本\r\n".encode() + b"\xff\xc3"


class TokenizerError(ValueError):
    """A tokenizer model that cannot encode bytes exactly (see the module docstring)."""


# --------------------------------------------------------------------------------------------- tables

_TABLES: dict[int, tuple[object, list[bytes], list[int]]] = {}


def _tables(sp) -> tuple[list[bytes], list[int]]:
    """(bytes of every id, byte-piece id of every byte value), cached per processor object."""
    hit = _TABLES.get(id(sp))
    if hit is not None and hit[0] is sp:
        return hit[1], hit[2]
    table: list[bytes] = []
    byte_ids = [-1] * 256
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            value = int(piece[3:5], 16)
            table.append(bytes([value]))
            byte_ids[value] = i
        elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            table.append(b"")
        else:
            table.append(piece.replace("\u2581", " ").encode("utf-8"))
    if len(_TABLES) > 64:
        _TABLES.clear()
    _TABLES[id(sp)] = (sp, table, byte_ids)  # holding sp keeps id(sp) from being reused while cached
    return table, byte_ids


def token_bytes(sp) -> list[bytes]:
    """The bytes each id stands for (index = id): byte pieces their byte, normal pieces their text
    with U+2581 read as a space, control and unknown pieces b""."""
    return _tables(sp)[0]


def check_tokenizer(sp, where: str = "tokenizer") -> None:
    """Raise TokenizerError unless ``sp`` satisfies the encode/decode contract."""
    _, byte_ids = _tables(sp)
    if min(byte_ids) < 0:
        raise TokenizerError(f"{where}: no byte-fallback pieces <0x00>..<0xFF>; train it with byte_fallback=True "
                             "(megatok-train-bpe does)")
    if decode_ids(sp, encode_bytes(sp, _PROBE)) != _PROBE:
        raise TokenizerError(f"{where}: does not round-trip text exactly (normalisation or a dummy prefix?); "
                             "train it with megatok-train-bpe, which sets "
                             + ", ".join(f"{k}={SP_OPTIONS[k]}" for k in CONTRACT_OPTIONS))


def load_tokenizer(path: str | os.PathLike):
    """A sentencepiece processor for a .model file (or a directory holding tokenizer.model), checked
    against the encode/decode contract."""
    import sentencepiece as spm

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.model"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer model (train one with megatok-train-bpe)")
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise TokenizerError(f"{path}: not a sentencepiece model ({str(e).splitlines()[0]})") from None
    check_tokenizer(sp, str(path))
    return sp


def report_bytes_per_token(report_path: Path) -> float | None:
    """Bytes per token from a megatok-train-bpe report.json: the training text's, else the first held-out set's."""
    if not report_path.is_file():
        return None
    try:
        rep = json.loads(report_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{report_path}: not valid JSON ({e.msg})") from None
    candidates = [rep.get("train")] + list((rep.get("heldout") or {}).values())
    for c in candidates:
        if isinstance(c, dict) and isinstance(c.get("bytes_per_token"), (int, float)) and c["bytes_per_token"] > 0:
            return float(c["bytes_per_token"])
    return None


def tokenizer_facts(path: str) -> tuple[str, int, float | None]:
    """(model file, pieces, bytes per token from report.json or None) of a train_bpe output."""
    p = Path(path)
    model = p / "tokenizer.model" if p.is_dir() else p
    try:
        sp = load_tokenizer(model)
    except Exception as e:  # FileNotFoundError, TokenizerError
        raise ConfigError(f"--tokenizer {path}: {e}") from None
    return str(model), sp.get_piece_size(), report_bytes_per_token(model.parent / "report.json")


# --------------------------------------------------------------------------------------------- encode / decode

def _runs(data: bytes) -> list[str]:
    """Alternating [text, raw, text, raw, ..., text] runs of the surrogateescape decoding of data."""
    return _RAW.split(data.decode("utf-8", "surrogateescape"))


def _raw_ids(run: str, byte_ids: list[int]) -> list[int]:
    out = []
    for ch in run:
        if ch == "\u2581":
            out.extend(byte_ids[b] for b in ch.encode("utf-8"))
        else:
            out.append(byte_ids[ord(ch) - 0xDC00])
    return out


def encode_batch(sp, datas: Iterable[bytes]) -> list[list[int]]:
    """encode_bytes for several byte strings at once (one multi-threaded sentencepiece call)."""
    _, byte_ids = _tables(sp)
    split = [_runs(d) for d in datas]
    texts = [r for runs in split for r in runs[0::2] if r]
    encoded = iter(sp.encode(texts) if texts else [])
    out = []
    for runs in split:
        ids: list[int] = []
        for k, run in enumerate(runs):
            if k % 2:
                ids.extend(_raw_ids(run, byte_ids))
            elif run:
                ids.extend(next(encoded))
        out.append(ids)
    return out


def encode_bytes(sp, data: bytes) -> list[int]:
    """Token ids of arbitrary bytes; exact: ``decode_ids(sp, encode_bytes(sp, data)) == data``."""
    return encode_batch(sp, [bytes(data)])[0]


def decode_ids(sp, ids: Iterable[int]) -> bytes:
    """The bytes the ids stand for (control ids stand for none); the inverse of encode_bytes."""
    table = token_bytes(sp)
    return b"".join(table[i] for i in ids)


def token_byte_lengths(sp, ids: Iterable[int]) -> list[int]:
    """UTF-8 bytes per token (0 for control tokens). Their sum is the byte count of the text."""
    table = token_bytes(sp)
    return [len(table[i]) for i in ids]


def token_starts(sp, ids: Iterable[int]) -> list[int]:
    """Byte offset in the text at which each token starts."""
    out, pos = [], 0
    for n in token_byte_lengths(sp, ids):
        out.append(pos)
        pos += n
    return out


# --------------------------------------------------------------------------------------------- measures

def bytes_per_token(sp, docs: Iterable, *, batch: int = 64, progress=None) -> dict:
    """Bytes per token over documents (``megatok.data.documents.Document``s or plain bytes), each
    encoded on its own: {"documents", "bytes", "tokens", "bytes_per_token"} overall, and the same
    under "by_lang" / "by_domain" when the documents carry that metadata. ``progress``: a tqdm-like
    object whose update() gets the bytes done."""
    sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # documents, bytes, tokens

    def flush(pending):
        for (lang, domain, text), ids in zip(pending, encode_batch(sp, [p[2] for p in pending])):
            for key in (("all", "all"), ("lang", lang), ("domain", domain)):
                s = sums[key]
                s[0] += 1
                s[1] += len(text)
                s[2] += len(ids)
            if progress is not None:
                progress.update(len(text))
        pending.clear()

    pending: list[tuple[str, str, bytes]] = []
    for d in docs:
        text = d if isinstance(d, (bytes, bytearray)) else d.text
        lang = None if isinstance(d, (bytes, bytearray)) else d.lang
        domain = None if isinstance(d, (bytes, bytearray)) else d.domain
        pending.append((lang or "unknown", domain or "unknown", bytes(text)))
        if len(pending) >= batch:
            flush(pending)
    flush(pending)

    def report(key):
        n_docs, n_bytes, n_tokens = sums[key]
        return {"documents": n_docs, "bytes": n_bytes, "tokens": n_tokens,
                "bytes_per_token": n_bytes / n_tokens if n_tokens else float("nan")}

    out = report(("all", "all"))
    for kind in ("lang", "domain"):
        names = sorted(n for k, n in sums if k == kind)
        if names and names != ["unknown"]:
            out[f"by_{kind}"] = {n: report((kind, n)) for n in names}
    return out


def disparity(values: dict[str, float]) -> float:
    """max / min of the finite positive values (NaN if fewer than two): the spread across languages."""
    v = [x for x in values.values() if isinstance(x, (int, float)) and math.isfinite(x) and x > 0]
    return max(v) / min(v) if len(v) >= 2 else float("nan")


def token_bpb(total_token_nll_nats: float, n_bytes: int) -> float:
    """Bits per byte of a token model: summed token NLL (nats) over the text's UTF-8 byte count."""
    return total_token_nll_nats / n_bytes / math.log(2) if n_bytes else float("nan")


def bpb_from_token_nll(sp, target_ids: Iterable[int], nll_nats: Iterable[float]) -> dict:
    """BPB from per-target NLLs: {"nll", "bytes", "tokens", "bpb"}. Targets that stand for no bytes
    (control ids such as a ``</s>`` separator) are left out of the NLL, as megatok leaves SEP out;
    "bytes" is the sum of the other targets' byte lengths, i.e. the UTF-8 bytes of the text they spell."""
    table = token_bytes(sp)
    nll, n_bytes, n_tokens = 0.0, 0, 0
    for t, v in zip(target_ids, nll_nats, strict=True):
        n = len(table[t])
        if n:
            nll += float(v)
            n_bytes += n
            n_tokens += 1
    return {"nll": nll, "bytes": n_bytes, "tokens": n_tokens, "bpb": token_bpb(nll, n_bytes)}


# --------------------------------------------------------------------------------------------- training

def training_sentences(text: bytes, max_bytes: int = SENTENCE_BYTES) -> Iterator[str]:
    """The pieces of one document that sentencepiece trains on: the text runs of the encode contract
    (raw bytes and U+2581 are never learned, they are always byte pieces), cut after a newline so
    each piece is at most max_bytes (a longer line is cut at a character boundary)."""
    for k, run in enumerate(_runs(text)):
        if k % 2 or not run:
            continue
        cur, size = [], 0
        for line in run.splitlines(keepends=True):
            n = len(line.encode("utf-8"))
            if size + n > max_bytes and cur:
                yield "".join(cur)
                cur, size = [], 0
            while n > max_bytes:  # one overlong line: cut it at character boundaries
                cut = len(line.encode("utf-8")[:max_bytes].decode("utf-8", "ignore"))
                yield line[:cut]
                line = line[cut:]
                n = len(line.encode("utf-8"))
            if line:
                cur.append(line)
                size += n
        if cur:
            yield "".join(cur)


def _sentencepiece_error(text: str, opts: dict) -> str:
    """sentencepiece's error as one line in megatok's terms: its C++ location dropped, its option names
    (``--character_coverage``) given as megatok-train-bpe spells them, the common case explained."""
    first = re.sub(r"^(INTERNAL|INVALID_ARGUMENT|[A-Z_]+): \S+\.(cc|h)\(\d+\) \[[^]]*\] ", "", text.splitlines()[0])
    small = re.match(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)\.", first)
    if small:
        return (f"--vocab-size {small.group(1)} is below the {small.group(2)} pieces it must hold (the text's "
                f"characters at --character-coverage {opts['character_coverage']:g}, the 256 byte pieces and the "
                f"special ones): raise --vocab-size, or lower --character-coverage (rarer characters then fall back "
                f"to bytes)")
    return "sentencepiece training failed: " + re.sub(r"--(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), first)


def train_bpe(docs: Iterable, out: str | os.PathLike, vocab_size: int, *, max_bytes: int | None = None,
              progress: bool = False, **options) -> dict:
    """Train a byte-fallback BPE sentencepiece model on documents (Documents or bytes); write it to
    ``out`` (a directory: OUT/tokenizer.model, or a path ending in .model). Stops feeding after the
    document that brings the total to ``max_bytes``. ``options`` override :data:`SP_OPTIONS` (not
    the contract ones). Returns {"model", "vocab_size", "requested_vocab_size", "documents", "bytes",
    "options"}."""
    import sentencepiece as spm
    from tqdm.auto import tqdm

    bad = sorted(k for k in options if k in CONTRACT_OPTIONS and options[k] != SP_OPTIONS[k])
    if bad:
        raise ValueError(f"options {', '.join(bad)} are fixed by the encode/decode contract")
    if vocab_size < 260:
        raise ValueError(f"vocab_size must be at least 260 (256 byte pieces + 3 specials + 1), got {vocab_size}")
    out = Path(out)
    model_path = out if out.suffix == ".model" else out / "tokenizer.model"
    opts = {**SP_OPTIONS, **options, "vocab_size": vocab_size}
    fed = {"documents": 0, "bytes": 0}
    bar = tqdm(total=max_bytes, unit="B", unit_scale=True, desc="train_bpe (documents fed)", disable=not progress)

    def sentences():
        for d in docs:
            text = bytes(d if isinstance(d, (bytes, bytearray)) else d.text)
            if max_bytes is not None and fed["bytes"] >= max_bytes:
                break
            fed["documents"] += 1
            fed["bytes"] += len(text)
            bar.update(len(text))
            yield from training_sentences(text, min(SENTENCE_BYTES, opts["max_sentence_length"]))

    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=sentences(), model_writer=buf, **opts)
    except RuntimeError as e:
        raise ValueError(_sentencepiece_error(str(e), opts)) from None
    finally:
        bar.close()
    if not fed["bytes"]:
        raise ValueError("no text to train on")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_path.with_name(model_path.name + f".tmp-{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, model_path)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    check_tokenizer(sp, str(model_path))
    return {"model": str(model_path), "vocab_size": sp.get_piece_size(), "requested_vocab_size": vocab_size,
            **fed, "options": {k: v for k, v in opts.items() if k not in ("minloglevel", "num_threads")}}

