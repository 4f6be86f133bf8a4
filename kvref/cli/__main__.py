"""``python -m kvref.cli ...``: the same entry point as the ``kvref`` command."""

from kvref.cli import main

raise SystemExit(main())
