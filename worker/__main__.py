"""``python -m worker``: the same as ``kvroute worker``."""

from worker.serve.cli import main

raise SystemExit(main())
