"""``python -m metrics_logger [--config FILE] [KEY=VALUE ...]`` (also ``rlbus logger``)."""

from metrics_logger.app import main

if __name__ == "__main__":
    raise SystemExit(main())
