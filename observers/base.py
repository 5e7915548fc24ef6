"""The observer base class and the one registry of observers.

An observer is a small class: it declares its registry ``name``, a one-line ``description``,
its ``knobs`` (each a ``Knob``: default, type, bounds, one line of doc), and implements
``_observe(flat)`` (update statistics from a flattened batch) and ``_choose_range()`` (the chosen
``(min, max)`` per qparam group). Input checks, flattening, token counting, checking every knob
value against its declaration and the range -> qparams rule live here, once; an observer's
``validate_knobs`` only adds the rules that relate two knobs, or a knob and the spec.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch

from observers.granularity import Flat, all_finite, flatten
from observers.knobs import Knob
from observers.qparams import QParams, calculate_qparams
from observers.shared import MEAN_OF_RANGES, NOT_MERGED, WEIGHTS_ONLY, Op, Reduce, agree
from observers.spec import QuantSpec
from observers.vocab import ObserverKind

_REGISTRY: dict[str, type[Observer]] = {}

COMMON_KNOBS: dict[str, Knob] = {
    "ignore_nonfinite": Knob(
        False, bool, doc="Replace NaN/Inf in observed data by 0 instead of raising an error naming their count"
    ),
}
"""Knobs every observer takes (``Observer.observe`` implements them)."""


class NonFiniteStatistics(Exception):
    """Raised by ``_observe`` (before changing any state) when its statistics came out NaN/Inf;
    ``observe`` then handles the input's non-finite values and observes again."""


class Observer:
    """Turns observed tensors into ``QParams``.

    Use: ``obs.observe(x)`` any number of times (calibration batches), then ``obs.qparams()``.
    Knob values are checked against their ``Knob`` declarations and set as attributes
    (``obs.percentile``); ``obs.config`` holds them all.
    Common knob: ``ignore_nonfinite`` (default False): NaN/Inf in ``x`` are an error naming how
    many, unless this knob is set; they are then replaced by 0, which every range contains, so
    scales are those of the finite values.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    knobs: ClassVar[dict[str, Knob]] = {}
    kinds: ClassVar[tuple[str, ...]] = tuple(ObserverKind)
    strategies: ClassVar[tuple[str, ...] | None] = None
    scale_kinds: ClassVar[tuple[str, ...]] = ("float", "e8m0", "e4m3", "pow2")
    tuned_for: ClassVar[tuple[str, ...] | None] = None
    """Element formats (dtype names) whose defaults this observer was tuned for; it still runs on
    any format it accepts, but ``applicable`` leaves it out of the default set of other formats."""
    checks_finite_itself: ClassVar[bool] = False
    merge_rule: ClassVar[str] = MEAN_OF_RANGES
    """How ranks that split a batch merge this observer's statistics (``observers.shared``)."""
    shares_statistics: ClassVar[bool] = False
    """True when ``_observe`` reduces its statistics with ``self._across`` (exact merges); else
    every rank observes alone and ``qparams`` takes the token-weighted mean of the ranges."""
    once_as: ClassVar[str | None] = None
    """The observer whose qparams this one's are after a single ``observe`` (a weight, observed
    once): its rule for combining batches never runs then. ``once_form`` gives it and its knobs."""
    combining_knobs: ClassVar[tuple[str, ...]] = ()
    """The knobs of that combining rule, which the ``once_as`` observer does not take."""

    def __init__(self, spec: QuantSpec, kind: str = "weight", **knobs: Any) -> None:
        if not isinstance(spec, QuantSpec):
            raise ValueError(f"spec must be a QuantSpec, got {type(spec).__name__}")
        spec.check_kind(kind)
        kind = ObserverKind(kind).value
        if kind not in self.kinds:
            raise ValueError(f"observer {self.name!r} works on {', '.join(self.kinds)}, not kind={kind!r}")
        if self.strategies is not None and spec.strategy not in self.strategies:
            raise ValueError(
                f"observer {self.name!r} supports strategy {', '.join(self.strategies)}, not {spec.strategy!r}"
            )
        if spec.format.scale_kind not in self.scale_kinds and spec.format.kind != "cast":
            raise ValueError(f"observer {self.name!r} does not support dtype {spec.dtype!r}")
        declared = self.knob_specs()
        unknown = set(knobs) - set(declared)
        if unknown:
            raise ValueError(
                f"unknown knob(s) for observer {self.name!r}: {', '.join(sorted(unknown))}; "
                f"allowed: {', '.join(sorted(declared)) or 'none'}"
            )
        self.spec = spec
        self.kind = kind
        self.config = {name: knob.coerce(name, knobs.get(name, knob.default)) for name, knob in declared.items()}
        for key, value in self.config.items():
            setattr(self, key, value)
        self.num_observed_tokens = 0
        self._qparam_shape: tuple[int, ...] | None = None
        self._feature_shape: tuple[int, ...] | None = None
        self._g_idx: torch.Tensor | None = None
        self._across: Reduce | None = None
        self._apart = 1
        """How many weights the last observed batch stacks (``observe(apart=…)``)."""
        self._merge: Reduce | None = None
        self._part: torch.Tensor | None = None
        self._local_tokens = 0
        self.validate_knobs()

    @classmethod
    def knob_specs(cls) -> dict[str, Knob]:
        """This observer's knob declarations, the common ones included."""
        return {**COMMON_KNOBS, **cls.knobs}

    @classmethod
    def all_knobs(cls) -> dict[str, Any]:
        """This observer's knobs with defaults, the common ones included."""
        return {name: knob.default for name, knob in cls.knob_specs().items()}

    def validate_knobs(self) -> None:
        """Check rules between knobs, or between a knob and the spec (each value alone is already
        checked against its declaration); subclasses raise ``ValueError`` naming the knobs."""

    def _check_input(self, x: torch.Tensor, part: bool = False) -> None:
        """``x`` can be observed; a rank's ``part`` of a split batch may be empty (no tokens) if
        it still has its feature dimensions."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"observe() needs a torch.Tensor, got {type(x).__name__}")
        if x.ndim == 0:
            raise ValueError("observe() needs a tensor with at least one dimension, got a 0-d tensor")
        if x.numel() == 0 and not (part and x.ndim >= 2):
            raise ValueError(f"observe() got an empty tensor of shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"observe() needs a floating-point tensor, got {x.dtype}")

    def _without_nonfinite(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself when it is all finite; else an error naming the count, or (with
        ``ignore_nonfinite``) a copy with NaN/Inf replaced by 0, which every range contains."""
        finite = torch.isfinite(x)
        bad = int((~finite).sum())
        if not bad:
            return x
        if not self.ignore_nonfinite:
            raise ValueError(
                f"observed tensor has {bad} non-finite value(s) (NaN/Inf) out of {x.numel()}; "
                "pass ignore_nonfinite=True to exclude them"
            )
        if bad == x.numel():
            raise ValueError("observed tensor has no finite values")
        return torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def observe(
        self, x: torch.Tensor, g_idx: torch.Tensor | None = None, *, across: Reduce | None = None, apart: int = 1
    ) -> None:
        """Update the statistics with one batch (a weight, or a calibration batch of activations).

        Non-finite values are detected cheaply: by the observer's own statistics when it sets
        ``checks_finite_itself`` (min/max propagate NaN/Inf), else by one sum of the tensor;
        only then is the tensor scanned element by element.

        ``across``: this batch is one rank's part of a batch split between processes, and every
        rank calls ``observe`` in lockstep with the same reduction (``observers.shared``); a
        rank's part may be empty. Afterwards every rank holds the statistics of the whole batch
        (``merge_rule`` says how exactly).

        ``apart``: ``x`` is that many weights of equal rows stacked, a group or channel spec, each
        weight to get the qparams it would get observed alone, in one pass. Group and channel
        statistics are their rows' own; a search whose rule reads the whole weight (a shrink
        grid's early stop once no group improves, a histogram screen sized by the row count)
        reads ``_apart``, the last batch's count, and searches each weight as if alone.
        """
        if apart != 1:
            self._check_apart(x, apart, across)
        self._apart = apart
        if across is not None:
            self._observe_part(x, g_idx, across)
            return
        self._check_input(x)
        if not self.checks_finite_itself and not all_finite(x):
            x = self._without_nonfinite(x)
        flat = flatten(x, self.spec, self.kind, g_idx=g_idx)
        self._check_shapes(x, flat)
        self._keep_g_idx(g_idx)
        with torch.no_grad():
            try:
                self._observe(flat)
            except NonFiniteStatistics:
                x = self._without_nonfinite(x)
                self._observe(flatten(x, self.spec, self.kind, g_idx=g_idx))
        self.num_observed_tokens += flat.num_tokens

    def _check_apart(self, x: torch.Tensor, apart: int, across: Reduce | None) -> None:
        """``observe(apart=...)`` reads stacked weights of a group or channel spec, in one process."""
        if not isinstance(apart, int) or isinstance(apart, bool) or apart < 1:
            raise ValueError(f"apart must be a positive int, got {apart!r}")
        if self.kind != "weight" or self.spec.strategy not in ("group", "channel") or across is not None:
            raise ValueError("apart stacks weights of a group or channel spec, observed in one process")
        rows = x.shape[0] if isinstance(x, torch.Tensor) and x.ndim else 0
        if rows % apart:
            raise ValueError(f"{rows} rows do not split into {apart} stacked weights of equal rows")

    def _observe_part(self, x: torch.Tensor, g_idx: torch.Tensor | None, across: Reduce) -> None:
        """``observe`` of one rank's part: every check that could refuse the part runs first and
        the ranks agree on it (no rank waits in a collective for one that gave up); per-token
        qparams stay per rank (``observers.shared.gather_tokens`` joins them)."""
        error, flat = None, None
        try:
            self._check_input(x, part=True)
            if x.numel() and not all_finite(x):
                x = self._without_nonfinite(x)
            flat = flatten(x, self.spec, self.kind, g_idx=g_idx)
            self._check_shapes(x, flat)
        except ValueError as err:
            error = err
        device = x.device if isinstance(x, torch.Tensor) else "cpu"
        tokens = agree(error, across, device, 0 if flat is None else flat.num_tokens)
        if tokens == 0:
            raise ValueError(f"observe() got no tokens on any rank (tensor shape {tuple(x.shape)} here)")
        self._keep_g_idx(g_idx)
        exact = self.shares_statistics or self.spec.strategy == "token"
        if not exact and type(self)._qparams is not Observer._qparams:
            raise ValueError(f"observer {self.name!r} cannot merge its statistics across ranks")
        with torch.no_grad():
            if exact and self.spec.strategy != "token":
                self._across = across
                try:
                    self._observe(flat)
                finally:
                    self._across = None
            elif flat.num_tokens:
                self._observe(flat)
        self._merge = None if exact else across
        self._part = x[:0]
        self._local_tokens = flat.num_tokens if self.spec.strategy == "token" else self._local_tokens + flat.num_tokens
        self.num_observed_tokens += tokens

    def _reduce(self, tensor: torch.Tensor, op: Op) -> torch.Tensor:
        """``tensor`` combined over the ranks sharing the batch under way (itself in one process)."""
        return tensor if self._across is None else self._across(tensor, op)

    def _keep_g_idx(self, g_idx: torch.Tensor | None) -> None:
        if g_idx is not None and not bool((g_idx == -1).any()):
            self._g_idx = g_idx.detach().clone()

    def _check_shapes(self, x: torch.Tensor, flat: Flat) -> None:
        """Features (and qparam shape, except per token) must not change between calls."""
        feature_shape = tuple(x.shape[1:]) if self.kind == "weight" else tuple(x.shape[-1:])
        if self.kind == "attention":
            feature_shape = (x.shape[1], x.shape[3])
        if self._feature_shape is not None and feature_shape != self._feature_shape:
            raise ValueError(
                f"observed shape changed between calls: features {self._feature_shape} before, {feature_shape} now"
            )
        token_wise = self.spec.strategy == "token"
        if self._qparam_shape is not None and flat.qparam_shape != self._qparam_shape and not token_wise:
            raise ValueError(
                f"observed shape changed between calls: qparam shape {self._qparam_shape} before, "
                f"{flat.qparam_shape} now (tensor shape {tuple(x.shape)})"
            )
        if token_wise:
            self._reset_statistics()
        self._feature_shape = feature_shape
        self._qparam_shape = flat.qparam_shape

    def qparams(self) -> QParams:
        """QParams from everything observed so far."""
        if self._qparam_shape is None:
            raise ValueError(f"observer {self.name!r} has observed nothing yet; call observe(x) first")
        with torch.no_grad():
            qp = self._qparams() if self._part is None or self._local_tokens else self._empty_part_qparams()
        qp.kind = self.kind
        if self._g_idx is not None:
            qp.extras["g_idx"] = self._g_idx.to(torch.int64)
        return qp

    def _qparams(self) -> QParams:
        min_val, max_val = self._choose_range() if self._merge is None else self._mean_range()
        return calculate_qparams(min_val, max_val, self.spec)

    def _empty_part_qparams(self) -> QParams:
        """QParams of a rank whose part had no tokens: none per token (``gather_tokens`` joins
        the others'), else the merged statistics, which the ranks share."""
        if self.spec.strategy != "token":
            return self._qparams()
        nothing = torch.zeros(self._qparam_shape, device=self._part.device)
        return calculate_qparams(nothing, nothing, self.spec)

    def _mean_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The token-weighted mean of every rank's own range (the fallback merge)."""
        if self._local_tokens:
            low, high = self._choose_range()
        else:
            low = high = torch.zeros(self._qparam_shape, device=self._part.device)
        weight = float(self._local_tokens)
        total = self._merge(torch.tensor([weight], dtype=torch.float64, device=low.device), Op.SUM)
        low = self._merge(low.double() * weight, Op.SUM) / total
        high = self._merge(high.double() * weight, Op.SUM) / total
        return low.float(), high.float()

    def _reset_statistics(self) -> None:
        """Forget earlier batches: per-token qparams describe the last batch's tokens only."""

    def _observe(self, flat: Flat) -> None:
        raise NotImplementedError

    def _choose_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def register(cls: type[Observer]) -> type[Observer]:
    """Class decorator: add an observer to the registry under ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY or cls.name in _ALIASES:
        raise ValueError(f"observer name {cls.name!r} is empty or registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def create(name: str, spec: QuantSpec, kind: str = "weight", **knobs: Any) -> Observer:
    """A new observer ``name`` (or an alias of one) for ``spec`` and ``kind`` (weight, activation or attention)."""
    return observer_class(name)(spec, kind=kind, **knobs)


def available() -> dict[str, str]:
    """``{name: one-line description}`` of every registered observer."""
    return {name: cls.description for name, cls in _REGISTRY.items()}


def applicable(spec: QuantSpec, kind: str = "weight") -> list[str]:
    """The observers a run on ``spec`` and ``kind`` uses by default, in registry order: those that
    accept them (strategy, dtype, kind) and are not tuned for another format (``tuned_for``).
    The rest would only fill a comparison with "not available" rows or searches meant for
    another format; they still run when named."""
    names = []
    for name, cls in _REGISTRY.items():
        if cls.tuned_for is not None and spec.dtype not in cls.tuned_for:
            continue
        try:
            cls(spec, kind=kind)
        except ValueError:
            continue
        names.append(name)
    return names


def observer_class(name: str) -> type[Observer]:
    """The registered class (its ``knob_specs()``, ``kinds``, docstring describe it); aliases resolve."""
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown observer {name!r}; available: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def knobs(name: str) -> dict[str, Any]:
    """The knobs of observer ``name`` with their defaults."""
    return dict(observer_class(name).all_knobs())


def once_form(name: str, knobs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The observer and knobs giving ``name``'s qparams with ``knobs`` after a single ``observe``
    (``Observer.once_as``: a running or moving-average min-max is the memoryless one there), so a
    search observing many weights once each runs such twins once; ``(name, knobs)`` otherwise."""
    cls = observer_class(name)
    if cls.once_as is None:
        return cls.name, dict(knobs)
    return cls.once_as, {key: value for key, value in knobs.items() if key not in cls.combining_knobs}


def merge_rule(name: str) -> str:
    """How observer ``name`` merges its statistics when ranks split a batch (``observers.shared``):
    exact, exact up to float rounding, approximate (and of what), or not at all."""
    cls = observer_class(name)
    if ObserverKind.ACTIVATION not in cls.kinds and ObserverKind.ATTENTION not in cls.kinds:
        return WEIGHTS_ONLY
    if not cls.shares_statistics and cls._qparams is not Observer._qparams:
        return NOT_MERGED
    return cls.merge_rule


def knob_specs(name: str) -> dict[str, Knob]:
    """The knob declarations of observer ``name`` (type, bounds, doc), for docs and widgets."""
    return observer_class(name).knob_specs()


def describe(name: str) -> str:
    """The full docstring of observer ``name`` (rule, knobs, reference)."""
    return inspect.getdoc(observer_class(name)) or ""


_ALIASES: dict[str, str] = {}
"""Names other tools use for a registered observer (``static_minmax`` -> ``minmax``): ``create``,
``observer_class`` and everything built on them accept an alias, while ``available`` lists each
observer once under its own name, so tables get no duplicate rows."""


def register_alias(alias: str, name: str) -> None:
    """Let ``alias`` (a name people type from another tool) stand for registered observer ``name``."""
    if alias in _REGISTRY or alias in _ALIASES or name not in _REGISTRY:
        raise ValueError(f"alias {alias!r} is already taken, or {name!r} is not a registered observer")
    _ALIASES[alias] = name


def aliases() -> dict[str, str]:
    """``{alias: observer name}`` of every alias."""
    return dict(_ALIASES)
