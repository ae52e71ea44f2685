"""Files and storage: what a run keeps on disk or in ``run.storage``. No Redis here.

- :mod:`storage.files`: atomic file writes, the one way rlbus replaces a file.
- :mod:`storage.run_storage`: ``run.storage``, a local folder or any fsspec URL.
- :mod:`storage.archive`: the events archive's segment files (entries trimmed from a run's
  events stream; :mod:`runtime.history` reads it and the stream as one log).

A leaf: it imports nothing of the project's but itself (tests/test_layering.py).
"""
