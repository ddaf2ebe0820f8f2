"""mtcli: an end-to-end neural machine translation toolkit (prepare, train, evaluate, translate).

From Python, a trained run translates through :class:`mtcli.Translator`::

    from mtcli import Translator
    translator = Translator.from_run("data/runs/multi30k_de_en", beam=5)
    translator.translate(["Ein Hund läuft im Schnee."])

``Translator`` is loaded on first use (PEP 562), so ``import mtcli`` and the command line do not
pay for importing torch until they need it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from mtcli.version import __version__

# This process and its parent when mtcli was first imported, a moment after the start.
_STARTED = (os.getpid(), os.getppid())


def started_by() -> int:
    """The process that started this one, as it was when mtcli was first imported: a torchrun
    rank compares its parent with it to find a launcher that died while the rank imported its
    modules (a second or more), which no parent-death signal then reports. A process forked
    from one that had imported mtcli (a notebook launcher) has its parent now."""
    pid, parent = _STARTED
    return parent if os.getpid() == pid else os.getppid()


__all__ = ["Translator", "__version__"]

if TYPE_CHECKING:
    from mtcli.infer.translator import Translator


def __getattr__(name: str) -> Any:
    if name == "Translator":
        from mtcli.infer.translator import Translator

        return Translator
    raise AttributeError(f"module 'mtcli' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with ``Translator`` (loaded lazily): what ``mtcli.<TAB>`` offers."""
    return sorted({*globals(), *__all__})
