"""``python -m tensorstore_hooks.cli``."""

import sys

from tensorstore_hooks.cli import main

sys.exit(main())
