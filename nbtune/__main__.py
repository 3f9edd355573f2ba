"""``python -m nbtune`` (and ``torchrun -m nbtune train run.yaml``): the command line."""

import sys

from .cli.main import main

sys.exit(main())
