"""FLASHDISPATCH_FA2_DECODE_CONFIG: a JSON object of `DecodeConfig` fields over a problem's defaults
(`apply_env` also reads FLASHDISPATCH_FA2_MLA_TILES, of `mla.MLATiles` fields)."""
from __future__ import annotations

import json
from typing import Callable, TypeVar

CONFIG_ENV = "FLASHDISPATCH_FA2_DECODE_CONFIG"
_EXAMPLE = '\'{"block_n": 64, "num_stages": 3}\''

_JSON_KINDS = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "an array",
               type(None): "null"}
C = TypeVar("C")


def apply_env(cfg: C, text: str, apply: Callable[[C, dict], C], var: str = CONFIG_ENV,
              example: str = _EXAMPLE) -> C:
    """``apply(cfg, fields)`` with the fields of ``text``, the value of the variable ``var``
    (blank: ``cfg``); every error names the variable, its value and the form expected (``example``)."""
    if not text.strip():
        return cfg
    try:
        fields = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{var}={text!r}: not JSON ({e}); expected an object such as {example}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{var}={text!r}: expected a JSON object such as {example}, "
                         f"got {_JSON_KINDS[type(fields)]}")
    try:
        return apply(cfg, fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{var}={text!r}: {e}") from e
