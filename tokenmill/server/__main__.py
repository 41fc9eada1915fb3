"""`python -m tokenmill.server ...` is `tokenmill serve ...`."""

import sys

from tokenmill.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
