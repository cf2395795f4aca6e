"""The configuration error, in a module of its own so that both config.py and dsconfig.py (which
config.py calls to check the ``deepspeed`` section) can raise it without importing each other."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A configuration mistake. The message is one line that names the file and the key."""


def suggest(key: str, valid, prefix: str = "") -> str:
    """" (did you mean 'PREFIX.close'?)" for the valid key closest to ``key``, else the valid keys."""
    close = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid keys: {', '.join(sorted(map(str, valid)))})"
