"""``Knob``: one observer knob declared once, with its type, bounds and one line of documentation.

An observer lists its knobs as ``{name: Knob(default, type, low=..., doc=...)}``; ``Observer``
checks every value against its declaration, the docs and the app's widgets read the same
declaration, so a knob's range is written in exactly one place. Rules that relate two knobs (or
a knob and the ``QuantSpec``) stay in the observer's ``validate_knobs``. This module imports no
torch: the app builds its knob widgets from it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

Number = int | float

_NOUNS = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}


def _is_instance(value: Any, kind: type) -> bool:
    """``isinstance`` with the knob rules: a bool is not a number, an int is a valid float."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


@dataclass(frozen=True)
class Knob:
    """How one knob is declared: ``default``, ``type`` and what values are allowed.

    - ``type``: ``bool``, ``int``, ``float`` (ints accepted and stored as floats), ``str``, or
      any class (e.g. ``torch.Tensor``); a bool is never accepted as a number.
    - ``low``/``high``: bounds of numeric knobs, inclusive unless ``low_open``/``high_open``.
    - ``choices``: the allowed strings of a ``str`` knob.
    - ``optional``: ``None`` is allowed too.
    - ``editable``: False for knobs a person should not edit in a widget (a tensor, say).
    - ``expects``: how messages name an allowed value when the type and bounds do not say it
      (e.g. ``"a 1-D float tensor of shape (in,)"``).
    - ``doc``: one line, what the knob does (docs and widget help).
    """

    default: Any
    type: type
    _: KW_ONLY
    doc: str
    low: Number | None = None
    high: Number | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    editable: bool = True
    expects: str = ""

    def __post_init__(self) -> None:
        numeric = self.type in (int, float)
        if (self.low is not None or self.high is not None) and not numeric:
            raise ValueError(f"bounds need an int or float knob, not {self.type.__name__}")
        if self.choices and self.type is not str:
            raise ValueError(f"choices need a str knob, not {self.type.__name__}")
        object.__setattr__(self, "choices", tuple(self.choices))
        object.__setattr__(self, "default", self.coerce("default", self.default))

    def allowed(self) -> str:
        """The allowed values in words: ``a number in (0, 100]``, ``an integer >= 2``, ``a bool``."""
        if self.choices:
            words = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            noun = self.expects or _NOUNS.get(self.type, f"a {self.type.__name__}")
            words = f"{noun} {self._range()}".rstrip()
        return f"{words} or None" if self.optional else words

    def _range(self) -> str:
        """``in (0, 1]``, ``>= 2``, ``> 0``, ``<= 16`` or nothing, from the bounds."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{self.low}, {self.high}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return ""

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is allowed (type, bounds and choices; NaN is never in bounds)."""
        if value is None:
            return self.optional
        if not _is_instance(value, self.type):
            return False
        if self.choices:
            return value in self.choices
        if self.low is not None and not (self.low < value if self.low_open else self.low <= value):
            return False
        return self.high is None or bool(value < self.high if self.high_open else value <= self.high)

    def check(self, name: str, value: Any) -> None:
        """Raise a ``ValueError`` naming the knob, the value and what is allowed, unless allowed."""
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self.allowed()}, got {value!r}")

    def coerce(self, name: str, value: Any) -> Any:
        """``value`` checked, with an int given for a float knob turned into a float, so an observer
        (and what it reports as its config) sees the declared type."""
        self.check(name, value)
        return float(value) if self.type is float and value is not None else value

    def describe(self) -> str:
        """Help text for docs and widgets: what the knob does, what is allowed, the default."""
        return f"{self.doc.rstrip('.')}. Allowed: {self.allowed()}; default {self.default!r}."

    def widget_bounds(self) -> dict[str, Number]:
        """``min_value``/``max_value`` for a number widget, in the knob's type. An open integer
        end moves one step inside; an open float end stays the bound itself (a widget cannot
        exclude one point), which ``check`` then refuses."""
        if self.type not in (int, float):
            return {}
        step = 1 if self.type is int else 0
        bounds = {}
        if self.low is not None:
            bounds["min_value"] = self.type(self.low + (step if self.low_open else 0))
        if self.high is not None:
            bounds["max_value"] = self.type(self.high - (step if self.high_open else 0))
        return bounds
