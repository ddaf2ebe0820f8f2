"""``python -m mtcli`` and the ``mtcli`` script: the command line of :mod:`mtcli.cli`.

Its imports, and the building of its commands, take a second or so; a Ctrl-C during them ends
with the one line a Ctrl-C gets later, not Python's traceback."""

import sys


def main() -> None:
    """Import the command line, then run it."""
    try:
        from mtcli.cli import app

        app()
    except KeyboardInterrupt:
        sys.stderr.write("mtcli: error: interrupted\n")
        raise SystemExit(130) from None


if __name__ == "__main__":  # not when a new worker process imports it
    main()
