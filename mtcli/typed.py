"""A value read from YAML (or ``--set``) as the type a config field declares: ``coerce`` converts
it or raises ``TypeError``, and ``type_name`` says the type in an error message. Ints are taken
as floats, and plain decimal text as a float (PyYAML reads ``1e-9`` as a string)."""

from __future__ import annotations

import dataclasses
import numbers
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union


def type_name(tp: Any) -> str:
    """How a message names the type ``tp`` a value must have: ``'a' | 'b'``, ``int or null``,
    ``list of str``, ``a mapping of source, weight, ...``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"list of {type_name(inner)}"
    if dataclasses.is_dataclass(tp):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


# inf and nan too, so that validate() says they are not finite, rather than "not a float"
_FLOAT_TEXT = re.compile(r"[-+]?((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|inf|nan)", re.IGNORECASE)


#: The booleans a text may spell: YAML 1.1's, which mtcli's YAML 1.2 reading leaves as text
#: (:mod:`mtcli.yamlfile`), and YAML 1.2's own as a quoted value or a Python keyword gives them.
_BOOL_WORDS = {"yes": True, "on": True, "true": True, "no": False, "off": False, "false": False}


def coerce(value: Any, tp: Any, build: Callable[[type, dict[str, Any]], Any]) -> Any:
    """Return ``value`` converted to ``tp`` or raise ``TypeError`` (ints are accepted as floats);
    a mapping where ``tp`` is a dataclass is made one by ``build(tp, mapping)``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise TypeError
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg, build)
            except TypeError:
                continue
        raise TypeError
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise TypeError
        return [coerce(v, inner, build) for v in value]
    if tp is type(None):
        if value is None:
            return None
        raise TypeError
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        raise TypeError
    if tp is int:  # numpy's integers too (a value out of a pandas or numpy pipeline)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise TypeError
    if tp is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        # PyYAML (YAML 1.1) reads `1e-9` (no dot) as a string; accept plain decimal notation.
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)
        raise TypeError
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise TypeError
        return build(tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        # YAML reads `de` as text but numbers (`1`, `1.5`) as numbers; accept them as text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError
    raise TypeError


__all__ = ["coerce", "type_name"]
