"""The metrics logger: a subscriber of a run's events stream that writes experiment logs.

``trainer.logger`` takes verl's values. ``tensorboard`` writes TensorBoard event files under
``run.output_dir/RUN/tensorboard``; ``wandb`` logs to Weights & Biases in offline mode (under
``run.output_dir/RUN/wandb``) when the package is installed; ``console`` is the progress lines
every component prints; the other verl values are accepted with a warning. The trainer writes
nothing itself: this process reads StepFinished events, so it can start before, during or
after the run, and a restart continues from its stored position without duplicating points.
"""

from metrics_logger.app import (
    LOGGER_NAMES_WRITTEN,
    MetricsLogger,
    Position,
    logger_names,
    logger_warnings,
    main,
    position_file,
    tensorboard_dir,
)

__all__ = [
    "LOGGER_NAMES_WRITTEN",
    "MetricsLogger",
    "Position",
    "logger_names",
    "logger_warnings",
    "main",
    "position_file",
    "tensorboard_dir",
]
