"""Shared by the tests of UTF-8 checks: the short byte sequences on which a check must agree
with Python's decoder."""

from __future__ import annotations


def python_utf8(raw: bytes) -> bool:
    """Whether Python's strict decoder takes ``raw``."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def short_utf8_samples() -> list[bytes]:
    """Every 1- and 2-byte sequence, and 3- and 4-byte ones over every lead and second byte
    (overlong forms, surrogates, past U+10FFFF, cut short)."""
    edges = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0]
    samples = [bytes([a]) for a in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    samples += [bytes([a, b, c]) for a in range(0xE0, 0x100) for b in range(256) for c in edges]
    samples += [bytes([a, b, c, 0x80]) for a in range(0xF0, 0x100) for b in range(256) for c in (0x80, 0xBF, 0x41)]
    return samples
