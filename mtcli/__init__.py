"""mtcli: an end-to-end neural machine translation toolkit (prepare, train, evaluate, translate)."""

__version__ = "0.1.0"
