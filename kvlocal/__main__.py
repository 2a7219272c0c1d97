import sys

from kvlocal.cli import main

sys.exit(main())
