"""megatok.files.umask reads the process's umask without setting it (setting it, even for a moment, gives
another thread's new files the mask of that moment)."""

import os

import pytest

from megatok import files


def test_the_umask_is_read_without_being_set(monkeypatch):
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("os.umask called"))
        assert files.umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(old)
