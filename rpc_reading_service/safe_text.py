"""Text that came from a peer, made safe to log or put in an error message.

A peer that has not authenticated (and a buggy one that has) can send any bytes: a
newline in a package version or a refusal reason would otherwise start a forged log
line, and terminal escape sequences would reach whoever reads the log.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str, limit: int = 1024) -> str:
    """``text`` with backslashes and every non-printable character backslash-escaped (as
    ``repr`` writes them), cut to ``limit`` characters; one line, always."""
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable() and "\\" not in text:
        return text  # the common case: nothing to escape
    return "".join(_escape(c) for c in text)


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    return char if char.isprintable() else repr(char)[1:-1]
