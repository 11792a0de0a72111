"""``python -m pagedkv``: the command line of :mod:`pagedkv.cli`."""
import sys

from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main())
