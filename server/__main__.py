"""``python -m tensorstore_hooks.server [options]``: the same as ``tensorstore-hooks serve``."""

import argparse
import logging
import sys

from tensorstore_hooks.cli.serve import DESCRIPTION, add_arguments, run

parser = argparse.ArgumentParser(prog="python -m tensorstore_hooks.server", description=DESCRIPTION)
add_arguments(parser)
logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(run(parser.parse_args()))
