"""The ``pt-ray`` command line, one module per command (``train``, ``plan``, ``report``,
``export``, ``sweep``); :func:`main` is the console script's entry point."""

from pt_ray.cli.train import main

__all__ = ["main"]
