"""Checks of option values, with one message format: ``<owner>: <option> must be <what it may be>; got <value>``.

The methods' constructors, the compression configuration, ``compression: auto``'s settings, the optimizer and the
performance model's files check their options here, so that a wrong value is refused the same way everywhere:
booleans are not numbers (``ratio: true`` is not a ratio of 1), ranges read as intervals (``a number in (0, 1]``)
or in words at zero (``a positive integer``), and the message names the owner (a method, ``auto``, a file; empty:
the option alone), the option, what it may be and the value given. Each check returns the value (numbers as
floats), so that a caller may keep it.

Imports nothing of hvdcomp, torch or Horovod: every layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any, Literal, overload

Bound = int | float | None


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut to 80 characters (a long list)."""
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def invalid(owner: str, name: str, expected: str, value: Any) -> ValueError:
    """The error for option ``name`` of ``owner`` not being ``expected`` (a phrase: "a positive integer"); for the
    checks below, and for a rule they do not express (a mapping, a relation between two options)."""
    subject = f"{owner}: {name}" if owner else name
    return ValueError(f"{subject} must be {expected}; got {shown(value)}")


@overload
def number(owner: str, name: str, value: Any, *, gt: Bound = None, ge: Bound = None, lt: Bound = None,
           le: Bound = None, optional: Literal[False] = False, noun: str = "number",
           expected: str | None = None) -> float: ...


@overload
def number(owner: str, name: str, value: Any, *, gt: Bound = None, ge: Bound = None, lt: Bound = None,
           le: Bound = None, optional: Literal[True], noun: str = "number",
           expected: str | None = None) -> float | None: ...


def number(owner: str, name: str, value: Any, *, gt: Bound = None, ge: Bound = None, lt: Bound = None,
           le: Bound = None, optional: bool = False, noun: str = "number",
           expected: str | None = None) -> float | None:
    """``value`` as a float: a finite int or float, not a bool, with ``value > gt``, ``>= ge``, ``< lt``, ``<= le``
    (each bound that is given); ``None`` too if ``optional`` (YAML's null: "no limit", "off", where an option has
    one: never ``.inf``, which would reach a step as NaN or an overflow; a deadline without a limit is ``None``).

    The message says so from the bounds and ``noun`` ("fraction": "a fraction in [0, 1)"), or says ``expected``.
    """
    if value is None and optional:
        return None
    if _is_number(value) and _within(value, gt, ge, lt, le):
        return float(value)
    if expected is None:
        adjective, suffix = _range(gt, ge, lt, le, integral=False)
        expected = _a(f"{adjective}{noun}{suffix}")
        expected += " or null" if optional else ""
    raise invalid(owner, name, expected, value)


def integer(owner: str, name: str, value: Any, *, gt: Bound = None, ge: Bound = None, lt: Bound = None,
            le: Bound = None, multiple_of: int | None = None, expected: str | None = None) -> int:
    """``value``: an int, not a bool, within the bounds (as :func:`number`'s) and a multiple of ``multiple_of`` if
    given; the message says so ("an integer in [2, 8]", "a positive multiple of 8"), or says ``expected``."""
    if (isinstance(value, int) and not isinstance(value, bool) and _within(value, gt, ge, lt, le)
            and (multiple_of is None or value % multiple_of == 0)):
        return value
    if expected is None:
        adjective, suffix = _range(gt, ge, lt, le, integral=True)
        expected = _a(f"{adjective}{'integer' if multiple_of is None else f'multiple of {multiple_of}'}{suffix}")
    raise invalid(owner, name, expected, value)


def numbers(owner: str, name: str, value: Any, *, gt: Bound = None, ge: Bound = None, lt: Bound = None,
            le: Bound = None, nonempty: bool = False, noun: str = "numbers") -> tuple[float, ...]:
    """``value`` as a tuple of floats: a list or tuple (not a string) of numbers (finite, as :func:`number`'s) each
    within the bounds, and not empty if ``nonempty``; the message names them with the plural ``noun`` ("a non-empty
    list of finite compression factors > 1")."""
    if (isinstance(value, Sequence) and not isinstance(value, str | bytes) and (len(value) > 0 or not nonempty)
            and all(_is_number(item) and _within(item, gt, ge, lt, le) for item in value)):
        return tuple(float(item) for item in value)
    adjective, suffix = _range(gt, ge, lt, le, integral=False)
    raise invalid(owner, name, f"a {'non-empty ' if nonempty else ''}list of {adjective}{noun}{suffix}", value)


@overload
def boolean(owner: str, name: str, value: Any, *, optional: Literal[False] = False) -> bool: ...


@overload
def boolean(owner: str, name: str, value: Any, *, optional: Literal[True]) -> bool | None: ...


def boolean(owner: str, name: str, value: Any, *, optional: bool = False) -> bool | None:
    """``value``: True or False (not 0, 1 or "yes"); ``None`` too if ``optional`` (null: the default applies)."""
    if isinstance(value, bool) or (value is None and optional):
        return value
    raise invalid(owner, name, "true, false or null" if optional else "true or false", value)


def choice(owner: str, name: str, value: Any, choices: Collection[str]) -> str:
    """``value``: one of the strings ``choices``, which the message lists in their order."""
    if isinstance(value, str) and value in choices:
        return value
    raise invalid(owner, name, "one of " + ", ".join(choices), value)


def _is_number(value: Any) -> bool:
    """An int or a finite float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and (isinstance(value, int)
                                                                              or math.isfinite(value))


def _within(value: float, gt: Bound, ge: Bound, lt: Bound, le: Bound) -> bool:
    return ((gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt)
            and (le is None or value <= le))


def _range(gt: Bound, ge: Bound, lt: Bound, le: Bound, integral: bool) -> tuple[str, str]:
    """The bounds in words: (an adjective before the noun, a suffix after it). Both bounds read as an interval
    ("in (0, 1]"), a lower bound of 0 (or an integer's 1) as "positive" or "non-negative", another as "> 2"; a float
    not bounded on both sides is said to be finite."""
    if (gt is not None and ge is not None) or (lt is not None and le is not None):
        raise TypeError("give gt or ge, and lt or le, not both")
    low, high = (gt if ge is None else ge), (lt if le is None else le)
    if low is not None and high is not None:
        return "", f" in {'(' if ge is None else '['}{_bound(low)}, {_bound(high)}{')' if le is None else ']'}"
    finite = "" if integral else "finite "
    if high is not None:
        return finite, f" {'<' if le is None else '<='} {_bound(high)}"
    if low == 0 or (integral and ge == 1):
        return ("non-negative " if ge == 0 else "positive ") + finite, ""
    if low is not None:
        return finite, f" {'>' if ge is None else '>='} {_bound(low)}"
    return finite, ""


def _bound(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _a(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase
