"""Text with chunk starts marked, for terminals (megatok-show-boundaries, megatok-generate)."""

from __future__ import annotations


def characters(data: bytes) -> list[tuple[int, int, str]]:
    """(first byte, byte count, shown text) per character; invalid bytes shown as \\xNN."""
    out, i = [], 0
    while i < len(data):
        for n in (1, 2, 3, 4):
            try:
                ch = data[i:i + n].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        else:
            n, ch = 1, f"\\x{data[i]:02x}"
        out.append((i, n, ch))
        i += n
    return out


def char_marks(chars, starts: list[bool]) -> list[str]:
    """Per character: "start" (a chunk starts at its first byte), "inside" (at a later byte), or ""."""
    marks = []
    for first, n, _ in chars:
        if starts[first]:
            marks.append("start")
        elif any(starts[first + 1:first + n]):
            marks.append("inside")
        else:
            marks.append("")
    return marks


def marked(data: bytes, starts: list[bool], sep: str = "│") -> str:
    """``data`` as text with ``sep`` before every chunk after the first, and "¦" before a character
    inside which a chunk starts (a boundary between the bytes of one UTF-8 character)."""
    chars = characters(data)
    out = []
    for (first, n, ch), mark in zip(chars, char_marks(chars, starts)):
        if mark and first > 0:
            out.append(sep if mark == "start" else "¦")
        out.append("↵\n" if ch == "\n" else ch)
    return "".join(out)
