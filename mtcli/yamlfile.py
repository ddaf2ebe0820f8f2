"""YAML as mtcli reads it: PyYAML's safe loader (no Python objects), with two changes.

- A key given twice in one mapping is an error; the plain loader lets the second one win
  silently (a config's ``data:`` section written twice lost the first). A merge key
  (``<<: *defaults``) is no repeat: the mapping's own keys override what it merges.
- Only ``true`` and ``false`` are booleans, as in YAML 1.2: YAML 1.1 also reads ``no``, ``yes``,
  ``on`` and ``off`` as booleans, and so turned Norwegian's language code ``no`` into false.
  A boolean key still takes them (:func:`mtcli.typed.coerce`).
- Numbers are YAML 1.2's: ``42``, ``0o17``, ``0x10``, ``1.5``, ``1e-3``. YAML 1.1 read ``0042``
  as octal (a seed of 34), ``1:30`` as 90 and ``1_000`` as 1000; such text stays text here (a
  number key refuses it, a name keeps it: ``data.name: 007``), and ``1e-3`` is a number.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """The safe loader, with a mapping's repeated key a :class:`yaml.MarkedYAMLError` at its
    line, and YAML 1.2's booleans."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):  # unhashable: the loader's own error follows
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
                                   for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?(?:0|[1-9][0-9]*)|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT, re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
                                                 r"|[-+]?[0-9]+[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
                              list("-+.0123456789"))


def load_yaml(text: str) -> Any:
    """``text`` read as YAML (:class:`yaml.YAMLError` for bad YAML or a repeated key)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
