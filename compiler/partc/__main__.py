"""`python -m partc`: the `partc` command line, the same as the `partc` script."""

import sys

from partc.cli.main import main

sys.exit(main())
