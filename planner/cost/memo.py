"""Figures kept per object that cannot be a dict key (a profile, a cluster: frozen dataclasses
that hold lists and dicts), for as long as the object lives."""

from __future__ import annotations

import weakref

_CACHES: dict[int, tuple[weakref.ref, dict]] = {}


def cache_of(obj: object) -> dict:
    """A dict that lives as long as `obj` (by its identity: `obj` must not change)."""
    key = id(obj)
    hit = _CACHES.get(key)
    if hit is not None and hit[0]() is obj:
        return hit[1]

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _CACHES.get(key, (None,))[0] is ref:
            del _CACHES[key]

    cache: dict = {}
    _CACHES[key] = (weakref.ref(obj, forget), cache)
    return cache
