"""YAML as mtcli reads it: PyYAML's safe loader (no Python objects), refusing a key given twice
in one mapping, which the plain loader lets the second one win silently (a config's ``data:``
section written twice lost the first)."""

from __future__ import annotations

from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, with a mapping's repeated key a :class:`yaml.MarkedYAMLError` at its line."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):  # unhashable: the loader's own error follows
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """``text`` read as YAML (:class:`yaml.YAMLError` for bad YAML or a repeated key)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
