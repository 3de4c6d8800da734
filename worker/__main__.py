"""``python -m worker``: the same as ``kvroute worker``."""

from worker.cli import main

raise SystemExit(main())
