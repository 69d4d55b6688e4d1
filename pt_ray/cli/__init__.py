"""The ``pt-ray`` command line, one module per command (``train``, ``plan``, ``report``,
``export``, ``sweep``); :func:`main` runs one and returns its exit code, :func:`console` is the
console script's entry point."""

import gc
import sys
from typing import NoReturn

from pt_ray.cli.train import main

__all__ = ["console", "exit_quickly", "main"]


def exit_quickly(code: int) -> NoReturn:
    """End the process with ``code`` once a command is done, skipping the garbage collections
    Python runs over every object still alive as it shuts down (torch's, timm's and Ray's
    modules: seconds of CPU after a run, for nothing). What is alive goes
    to the permanent generation (``gc.freeze``), which those collections do not traverse;
    ``atexit`` handlers and the streams' flushes run as usual. Only for a process that ends
    here: in one that goes on, frozen objects would never be collected."""
    gc.freeze()
    sys.exit(code)


def console() -> NoReturn:
    """The ``pt-ray`` console script and ``python -m pt_ray.cli``."""
    exit_quickly(main())
