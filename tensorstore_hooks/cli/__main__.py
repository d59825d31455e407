"""``python -m tensorstore_hooks.cli``."""

import sys

from . import main

sys.exit(main())
