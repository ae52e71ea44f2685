"""``python -m trainer [--config FILE] [KEY=VALUE ...]``."""

from trainer.app import main

raise SystemExit(main())
