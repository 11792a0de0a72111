"""Strict checks on what a peer says: each control message field has a type and a range,
and a bool is never taken for an int. A field that fails names itself, what was
expected and what came (cut short), so a refusal says what the peer got wrong."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.format.fingerprint import shown

__all__ = ["Invalid", "integer", "optional", "text", "scalar", "anything", "exactly", "dict_of", "list_of_digits", "check"]


class Invalid(ValueError):
    """A field of a peer's message is malformed (the message says which and why)."""


Check = Callable[[Any], Any]


def integer(lo: int, hi: int) -> Check:
    def f(v):
        if type(v) is not int or not lo <= v <= hi:
            raise Invalid(f"an int in [{lo}, {hi}]")
        return v
    return f


def optional(inner: Check) -> Check:
    return lambda v: None if v is None else inner(v)


def text(limit: int = 1 << 16) -> Check:
    def f(v):
        if type(v) is not str or len(v) > limit:
            raise Invalid(f"a str of at most {limit} characters")
        return v
    return f


def scalar(v):
    """A JSON scalar (the namespace parts; lists and objects are not hashable ids)."""
    if v is not None and type(v) not in (str, int, float, bool):
        raise Invalid("null, a str, a number or a bool")
    return v


def exactly(value) -> Check:
    def f(v):
        if type(v) is not type(value) or v != value:
            raise Invalid(repr(value))
        return v
    return f


def anything(v):
    return v


def dict_of(v):
    if type(v) is not dict:
        raise Invalid("an object")
    return v


def list_of_digits(count: int) -> Check:
    """Exactly ``count`` decimal strings of at most 20 digits (64-bit hashes)."""
    def f(v):
        if type(v) is not list or len(v) != count or not all(
                type(x) is str and 0 < len(x) <= 20 and x.isdigit() and x.isascii() for x in v):
            raise Invalid(f"a list of {count} decimal hash strings")
        return v
    return f


def check(msg: Any, fields: dict[str, Check], what: str) -> str | None:
    """Why ``msg`` does not fit ``fields`` (None when it does). Fields are checked in
    order; a check may read fields checked before it (``msg`` is then a dict)."""
    if type(msg) is not dict:
        return f"{what}: expected a JSON object, got {type(msg).__name__}"
    for name, f in fields.items():
        if name not in msg:
            return f"{what}: field {name!r} missing"
        try:
            f(msg[name])
        except Invalid as e:
            return f"{what}: field {name!r}: expected {e}, got {shown(msg[name], 80)}"
    return None
