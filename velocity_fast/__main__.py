"""`python -m velocity_fast ...` is `velocityllm ...`."""

import sys

from .cli import main

sys.exit(main())
