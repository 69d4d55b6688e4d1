"""``python -m pt_ray.cli ...``: the ``pt-ray`` command."""

import sys

from pt_ray.cli.train import main

sys.exit(main())
