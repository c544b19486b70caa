"""``python -m objfs`` is the ``objfs`` command."""

import sys

from objfs.cli import main

sys.exit(main())
