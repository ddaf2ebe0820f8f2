"""``python -m mtcli``: the same command line as the ``mtcli`` script."""

from mtcli.cli import app

if __name__ == "__main__":  # not when a new worker process imports it
    app()
