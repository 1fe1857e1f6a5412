"""`python -m runtime plan.json --model model.py ...` (see runtime.cli)."""

import sys

from runtime.cli import main

sys.exit(main())
