"""``python -m tokenmill.train``: see :mod:`tokenmill.train.cli`."""

import sys

from tokenmill.train.cli import main

sys.exit(main())
