"""``python -m trainer [--config FILE] [KEY=VALUE ...]``."""

from trainer import main

raise SystemExit(main())
