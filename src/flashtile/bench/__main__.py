"""``python -m flashtile.bench``."""

from flashtile.bench.cli import main

raise SystemExit(main())
