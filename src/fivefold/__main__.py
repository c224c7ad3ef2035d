"""`python -m fivefold` is the `fivefold` command line."""

from fivefold.cli import main

raise SystemExit(main())
