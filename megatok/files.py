"""The process's file-creation mask, read without changing it."""

from __future__ import annotations

import os


def umask() -> int:
    """The current umask. Linux reports it in /proc/self/status; elsewhere it can only be read by setting
    it (os.umask) and restoring it, a moment in which another thread's new files would get mode 0666."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)  # the fallback's moment errs on the private side
    os.umask(mask)
    return mask
