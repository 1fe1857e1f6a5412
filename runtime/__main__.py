"""`python -m runtime plan.json --model model.py ...` (see runtime.cli), or
`python -m runtime calibrate ...` (see runtime.calibrate)."""

import sys

if sys.argv[1:2] == ["calibrate"]:
    from runtime.calibrate import main as calibrate

    sys.exit(calibrate(sys.argv[2:]))

from runtime.cli import main  # noqa: E402

sys.exit(main())
