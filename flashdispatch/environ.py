"""Environment variables read on hot paths (every plan(), run() or single-request call).

``os.environ.get`` of an unset name costs ~2 us (its Mapping.get raises and catches a KeyError),
and plan() reads three such switches; `env_get` reads the environ's own mapping the way its
``__getitem__`` does (~0.2 us), so a value set or removed at run time through ``os.environ``
(or pytest's ``monkeypatch.setenv``) is seen at the next read.
"""
from __future__ import annotations

import os

_data = getattr(os.environ, "_data", None)
_encodekey = getattr(os.environ, "encodekey", None)
_decodevalue = getattr(os.environ, "decodevalue", None)
_VERIFIED = isinstance(_data, dict) and callable(_encodekey) and callable(_decodevalue)
_keys: dict[str, object] = {}  # name -> its key in the environ's mapping


def env_get(name: str) -> str | None:
    """``os.environ.get(name)``: the variable's value, None when it is unset."""
    if not _VERIFIED or getattr(os.environ, "_data", None) is not _data:  # (os.environ replaced)
        return os.environ.get(name)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _encodekey(name)
    value = _data.get(key)
    return None if value is None else _decodevalue(value)
