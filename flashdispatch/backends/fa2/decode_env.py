"""FLASHDISPATCH_FA2_DECODE_CONFIG: a JSON object of `DecodeConfig` fields over a problem's defaults."""
from __future__ import annotations

import json
from typing import Callable, TypeVar

CONFIG_ENV = "FLASHDISPATCH_FA2_DECODE_CONFIG"
_EXAMPLE = '\'{"block_n": 64, "num_stages": 3}\''

_JSON_KINDS = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "an array",
               type(None): "null"}
C = TypeVar("C")


def apply_env(cfg: C, text: str, apply: Callable[[C, dict], C]) -> C:
    """``apply(cfg, fields)`` with the fields of ``text``, the variable's value (blank: ``cfg``);
    every error names the variable, its value and the form expected."""
    if not text.strip():
        return cfg
    try:
        fields = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{CONFIG_ENV}={text!r}: not JSON ({e}); expected an object such as {_EXAMPLE}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{CONFIG_ENV}={text!r}: expected a JSON object such as {_EXAMPLE}, "
                         f"got {_JSON_KINDS[type(fields)]}")
    try:
        return apply(cfg, fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{CONFIG_ENV}={text!r}: {e}") from e
