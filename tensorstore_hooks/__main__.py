"""``python -m tensorstore_hooks`` runs the command line."""

import sys

from tensorstore_hooks.cli import main

sys.exit(main())
