"""``python -m rollouter [--config FILE] [KEY=VALUE ...]``."""

from rollouter import main

raise SystemExit(main(None))
