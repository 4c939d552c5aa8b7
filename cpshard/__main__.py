"""``python -m cpshard COMMAND [options]`` is ``cpshard COMMAND [options]``."""

import sys

from cpshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
