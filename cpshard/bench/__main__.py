"""``python -m cpshard.bench [ARGS]`` is ``cpshard bench [ARGS]``."""

import sys

from cpshard.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m cpshard.bench"))
