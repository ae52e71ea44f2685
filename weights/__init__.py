"""Weight transports: how a state dict goes from the trainer to the rollouters.

Each transport is one implementation of :class:`weights.transport.Transport`
(``rollout.weights_transport``):

- :mod:`weights.transport`: the manifest and chunks; ``RedisTransport`` (chunks in Redis,
  through ``bus``) and ``StorageTransport`` (files under ``run.storage``, fsspec);
- :mod:`weights.collective`: the gloo broadcast in rounds, planned through Redis;
  :mod:`weights.collective_round` is one round's blocking side (TCPStore, gloo, the worker
  thread);
- :mod:`weights.blobs`: claim-check blob stores (``RedisBlobStore``, ``DirBlobStore``).

It imports ``bus``, ``runschema`` and ``storage``, never a component (tests/test_layering.py).
"""
