"""mtcli: an end-to-end neural machine translation toolkit (prepare, train, evaluate, translate).

From Python, a trained run translates through :class:`mtcli.Translator`::

    from mtcli import Translator
    translator = Translator.from_run("data/runs/multi30k_de_en", beam=5)
    translator.translate(["Ein Hund läuft im Schnee."])

``Translator`` is loaded on first use (PEP 562), so ``import mtcli`` and the command line do not
pay for importing torch until they need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mtcli.version import __version__

__all__ = ["Translator", "__version__"]

if TYPE_CHECKING:
    from mtcli.infer.translator import Translator


def __getattr__(name: str) -> Any:
    if name == "Translator":
        from mtcli.infer.translator import Translator

        return Translator
    raise AttributeError(f"module 'mtcli' has no attribute {name!r}")
