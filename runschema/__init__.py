"""The run's schema: what every entry of a run's streams is, and what a reader may believe.

- :mod:`runschema.messages`: the messages (one msgspec tagged union), encoded and decoded.
- :mod:`runschema.authority`: which facts each writing role of the log may state.
- :mod:`runschema.facts`: rules every reader of the log applies to the facts it folds.

A leaf: it imports nothing of the project's (tests/test_layering.py), so ``bus``, the
components and the tools share one schema without importing each other.
"""
