"""A persistent (immutable) hash map, so that a frozen state can grow one entry at a time.

``m2 = m.set(key, value)`` returns a new map and leaves ``m`` as it was; the two share every
node but the one path from the root to ``key``. That path is at most 13 nodes of 32 slots
(a hash array mapped trie over the 64-bit ``hash(key)``), and with fewer than a million keys
it is 2-4 nodes, so a ``set`` or a ``get`` costs the same whether the map holds ten entries or
a hundred thousand. A plain dict copied on every change would cost O(size) instead.

Only what the profiler service's state needs: ``get``, ``in``, ``set``, ``len``, iteration
(in hash order, which varies between processes: sort where order matters), equality with
another map (same keys and equal values). No deletion.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar, cast

__all__ = ["PMap"]

K = TypeVar("K")
V = TypeVar("V")

_SHIFT = 5
_WIDTH = 1 << _SHIFT
_MASK = _WIDTH - 1
_HASH_MASK = (1 << 64) - 1
_EMPTY_NODE: tuple[Any, ...] = (None,) * _WIDTH
_MISSING: Any = object()


class _Leaf:
    """One key, its hash and its value."""

    __slots__ = ("h", "key", "value")

    def __init__(self, h: int, key: Any, value: Any) -> None:
        self.h = h
        self.key = key
        self.value = value


class _Collision:
    """Keys whose whole 64-bit hashes are equal: ``pairs`` in insertion order."""

    __slots__ = ("h", "pairs")

    def __init__(self, h: int, pairs: tuple[tuple[Any, Any], ...]) -> None:
        self.h = h
        self.pairs = pairs


def _hash(key: Any) -> int:
    return hash(key) & _HASH_MASK


def _join(a: _Leaf | _Collision, b: _Leaf, shift: int) -> tuple[Any, ...]:
    """A node holding ``a`` and ``b`` (different hashes) at depth ``shift``."""
    ia = (a.h >> shift) & _MASK
    ib = (b.h >> shift) & _MASK
    node = list(_EMPTY_NODE)
    if ia == ib:
        # Two different 64-bit hashes differ in some 5-bit chunk below bit 65: this ends.
        node[ia] = _join(a, b, shift + _SHIFT)
    else:
        node[ia] = a
        node[ib] = b
    return tuple(node)


def _assoc(
    node: tuple[Any, ...], shift: int, h: int, key: Any, value: Any
) -> tuple[tuple[Any, ...], bool] | None:
    """``node`` with ``key -> value``: ``(new node, whether a key was added)``, or None when
    ``key`` already maps to this very ``value``."""
    i = (h >> shift) & _MASK
    slot = node[i]
    result: tuple[Any, bool] | None
    if slot is None:
        result = _Leaf(h, key, value), True
    elif type(slot) is tuple:
        result = _assoc(slot, shift + _SHIFT, h, key, value)
    elif type(slot) is _Leaf:
        result = _assoc_leaf(slot, shift, h, key, value)
    else:
        result = _assoc_collision(cast(_Collision, slot), shift, h, key, value)
    if result is None:
        return None
    new, added = result
    return (*node[:i], new, *node[i + 1 :]), added


def _assoc_leaf(slot: _Leaf, shift: int, h: int, key: Any, value: Any) -> tuple[Any, bool] | None:
    """What replaces leaf ``slot`` once ``key -> value`` is in (see :func:`_assoc`)."""
    if slot.h != h:
        return _join(slot, _Leaf(h, key, value), shift + _SHIFT), True
    if slot.key is key or slot.key == key:
        return None if slot.value is value else (_Leaf(h, key, value), False)
    return _Collision(h, ((slot.key, slot.value), (key, value))), True


def _assoc_collision(collision: _Collision, shift: int, h: int, key: Any, value: Any,
                     ) -> tuple[Any, bool] | None:
    """What replaces ``collision`` once ``key -> value`` is in (see :func:`_assoc`)."""
    if collision.h != h:
        return _join(collision, _Leaf(h, key, value), shift + _SHIFT), True
    pairs = collision.pairs
    for j, (k, v) in enumerate(pairs):
        if k is key or k == key:
            if v is value:
                return None
            return _Collision(h, (*pairs[:j], (key, value), *pairs[j + 1 :])), False
    return _Collision(h, (*pairs, (key, value))), True


def _walk(node: tuple[Any, ...]) -> Iterator[tuple[Any, Any]]:
    for slot in node:
        if slot is None:
            continue
        if type(slot) is tuple:
            yield from _walk(slot)
        elif type(slot) is _Leaf:
            yield slot.key, slot.value
        else:
            yield from slot.pairs


class PMap(Generic[K, V]):
    """An immutable mapping; :meth:`set` returns a new one (see the module docstring)."""

    __slots__ = ("_len", "_root")

    def __init__(self, items: Iterable[tuple[K, V]] = ()) -> None:
        root = _EMPTY_NODE
        size = 0
        for key, value in items:
            result = _assoc(root, 0, _hash(key), key, value)
            if result is not None:
                root, added = result
                size += added
        self._root = root
        self._len = size

    @classmethod
    def _of(cls, root: tuple[Any, ...], size: int) -> PMap[K, V]:
        new: PMap[K, V] = cls.__new__(cls)
        new._root = root
        new._len = size
        return new

    def set(self, key: K, value: V) -> PMap[K, V]:
        """A map like this one with ``key -> value`` (this one if it already says so)."""
        result = _assoc(self._root, 0, _hash(key), key, value)
        if result is None:
            return self
        root, added = result
        return self._of(root, self._len + added)

    def get(self, key: K, default: Any = None) -> Any:
        """The value of ``key``, or ``default``."""
        h = _hash(key)
        node = self._root
        shift = 0
        while True:
            slot = node[(h >> shift) & _MASK]
            if slot is None:
                return default
            if type(slot) is tuple:
                node = slot
                shift += _SHIFT
                continue
            if type(slot) is _Leaf:
                if slot.h == h and (slot.key is key or slot.key == key):
                    return slot.value
                return default
            if slot.h == h:
                for k, v in slot.pairs:
                    if k is key or k == key:
                        return v
            return default

    def __getitem__(self, key: K) -> V:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return cast(V, value)

    def __contains__(self, key: object) -> bool:
        return self.get(cast(K, key), _MISSING) is not _MISSING

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        return (k for k, _ in _walk(self._root))

    def items(self) -> Iterator[tuple[K, V]]:
        """``(key, value)`` pairs in hash order."""
        return _walk(self._root)

    def values(self) -> Iterator[V]:
        """Values in hash order."""
        return (v for _, v in _walk(self._root))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PMap):
            return NotImplemented
        if self is other:
            return True
        if len(self) != len(other):
            return False
        return all(other.get(k, _MISSING) == v for k, v in self.items())

    __hash__ = None  # type: ignore[assignment]  # equal maps may hold unhashable values

    def __repr__(self) -> str:
        return f"PMap({dict(self.items())!r})"
