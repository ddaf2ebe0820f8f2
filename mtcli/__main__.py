"""``python -m mtcli``: the same command line as the ``mtcli`` script."""

from mtcli.cli import app

app()
