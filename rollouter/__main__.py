"""``python -m rollouter [--config FILE] [KEY=VALUE ...]``."""

from rollouter.app import main

raise SystemExit(main())
