"""`python -m partc.cli`: the `partc` command line."""

import sys

from partc.cli.main import main

sys.exit(main())
