"""``python -m pt_ray.cli ...``: the ``pt-ray`` command."""

from pt_ray.cli import console

console()
