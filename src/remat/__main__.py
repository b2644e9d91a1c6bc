"""``python -m remat``: the same as the ``remat`` command (see :mod:`remat.cli`)."""

from remat.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
