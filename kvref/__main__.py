"""``python -m kvref``: the ``kvref`` command, for when the script is not on PATH."""

import sys

from kvref.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m kvref"))
