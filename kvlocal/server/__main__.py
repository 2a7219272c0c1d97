"""``python -m kvlocal.server``: the ``kvlocal serve`` command."""

import sys

from kvlocal.server import main

sys.exit(main())
