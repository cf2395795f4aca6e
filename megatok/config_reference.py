"""Print the configuration reference (every key, its type, default and meaning) as markdown.

    megatok-config-reference            # print
    megatok-config-reference --check docs/config.md   # exit 1 if the copy in docs/config.md is stale
    megatok-config-reference --write docs/config.md   # refresh it

It is generated from the schema in megatok/config.py and the strategies' Options, so it cannot
drift from the code; docs/config.md holds a copy between two marker lines.
"""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel

from megatok.boundaries import available, strategy_options
from megatok.config import BoundaryConfig, Config, config_keys

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _type(ann) -> str:
    text = str(ann).replace("typing.", "")
    text = text.replace("<class '", "").replace("'>", "").replace("NoneType", "None")
    return text.replace("|", "or")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name in config_keys(model):
        f = model.model_fields[name]
        default = f.default_factory() if f.default_factory else f.default
        default = json.dumps(default.model_dump() if isinstance(default, BaseModel) else default)
        rows.append(f"| `{prefix}{name}` | {_type(f.annotation)} | `{default}` | {f.description or ''} |")
    return rows


def reference() -> str:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for section, f in Config.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _rows(ann, f"{section}.")
        else:
            out.append(f"| `{section}` | object | `{{}}` | DeepSpeed's own JSON, passed to deepspeed.initialize; "
                       "megatok fills batch sizes, optimizer, scheduler and clipping from `train` |")
    for name in available():
        opts = strategy_options(name)
        if opts.model_fields:
            out.append(f"| *`boundary.strategy = \"{name}\"` adds:* | | | |")
            out += _rows(opts, "boundary.")
    assert "strategy" in BoundaryConfig.model_fields
    return "\n".join(out) + "\n"



def sync(path: str, *, write: bool = False) -> int:
    """The copy between the markers in ``path`` replaced by today's reference (``write``), or compared with
    it; 0, or 1 with one error line when the markers are missing or the copy is stale (2 when ``path``
    cannot be read)."""
    try:
        text = open(path).read()
    except OSError as e:
        print(f"error: {path}: {e.strerror}", file=sys.stderr)
        return 2
    if BEGIN not in text or END not in text:
        print(f"error: {path}: markers {BEGIN} / {END} not found", file=sys.stderr)
        return 1
    before, rest = text.split(BEGIN, 1)
    copy, after = rest.split(END, 1)
    ref = reference()
    if write:
        open(path, "w").write(before + BEGIN + "\n" + ref + END + after)
        return 0
    if copy.strip("\n") + "\n" != ref:
        print(f"error: {path}: the configuration reference is stale; regenerate it with "
              f"megatok-config-reference --write {path}", file=sys.stderr)
        return 1
    return 0
