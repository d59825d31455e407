"""``python -m tensorstore_hooks.server [options]``: runs ``tensorstore-hooks serve [options]``.

The daemon's flags belong to the command line (``tensorstore_hooks/cli/serve.py``), which
imports the daemon when ``serve`` runs; the daemon's code never imports the command
line. This launcher only hands its arguments to that program, as the console script
would (so ``--help`` reads ``tensorstore-hooks serve``).
"""

import runpy
import sys

sys.argv = [sys.argv[0], "serve", *sys.argv[1:]]
runpy.run_module("tensorstore_hooks.cli", run_name="__main__", alter_sys=True)
