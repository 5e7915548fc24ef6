"""The figures of a search's picks beside its loss (issue 41): each balance layer's own output error
and clipped share on the calibration inputs, the mapping's and each layer's error on held-out
inputs, and AWQ then GPTQ's errors; the picks' weights made again a batch at a time and let go
after (issue 54: a 7B-wide pick is 360 MB of effective weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

import observers as ob
from lab.awq import candidates, then_gptq
from lab.awq.candidates import Candidate
from lab.awq.inputs import MappingInputs
from lab.awq.moment import InputMoment


class LayerFigures:
    """Each balance layer's own figures of a candidate on the inputs behind ``moment``: its output
    error ``‖WX − ŴX‖² / ‖WX‖²`` and the share of its smoothed weight clipped. The layers' output
    energies are computed once, and a candidate another row already picked (observers that agree,
    a variant keeping another's pick) is looked up by its digest."""

    def __init__(self, weights: dict[str, torch.Tensor], moment: InputMoment, spec: ob.QuantSpec) -> None:
        self.weights, self.spec, self.moment = weights, spec, moment
        self.energy = {name: moment.energy(w) for name, w in weights.items()}
        self._errors: dict[str, dict[str, float]] = {}
        self._clipped: dict[str, dict[str, float]] = {}

    def errors(self, candidate: Candidate) -> dict[str, float]:
        """The candidate's layer errors (its effective weights are needed the first time only)."""
        key = candidates.digest(candidate)
        if key not in self._errors:
            self._errors[key] = {
                name: self.moment.layer_error(w, candidate.effective[name], self.energy[name])
                for name, w in self.weights.items()
            }
        return self._errors[key]

    def clipped(self, candidate: Candidate) -> dict[str, float]:
        key = candidates.digest(candidate)
        if key not in self._clipped:
            self._clipped[key] = candidate.clipped(self.weights, self.spec)
        return self._clipped[key]


class Side:
    """One set of a mapping's inputs the picks are measured on (the calibration tokens, or held-out
    ones; the picks' weights do not depend on the tokens): the parent's float output and its energy
    once, each pick's loss by digest, each layer's figures. ``activations``: the bytes a stacked
    call's widest activation holds (``lab.awq.budget``)."""

    def __init__(self, inputs: MappingInputs, spec: ob.QuantSpec, activations: int) -> None:
        self.inputs, self.activations = inputs, activations
        self.reference = inputs.parent.outputs()
        self.energy = inputs.parent.energy(self.reference)
        weights = {name: layer.weight.detach() for name, layer in inputs.balance.items()}
        self.layers = LayerFigures(weights, inputs.moment, spec)
        self.losses: dict[str, float] = {}

    def relative(self, loss: float) -> float:
        """A loss as a share of the float output's energy (0 when both are 0)."""
        return loss / self.energy if self.energy > 0 else 0.0

    def judged(self, made: list[Candidate]) -> list[float]:
        """Each candidate's loss on these tokens (with its effective weights), stacked."""
        inputs = self.inputs
        effective = [c.effective for c in made]
        losses = inputs.parent.losses(
            inputs.balance, effective, self.reference, inputs.width, inputs.moment, self.activations
        )
        return [float(loss) for loss in losses]

    def measure(self, made: list[Candidate], losses: bool) -> None:
        """``made``'s layer figures, and with ``losses`` its losses (kept by digest)."""
        if losses:
            self.losses.update({c.key: loss for c, loss in zip(made, self.judged(made), strict=True)})
        for candidate in made:
            self.layers.errors(candidate)

    def error(self, candidate: Candidate) -> float:
        return self.relative(self.losses[candidates.digest(candidate)])


class PickFigures:
    """The figures of a search's picks (``light`` candidates), their weights made again a batch at
    a time (``remake``) and let go after: each layer's error and clipped share on the calibration
    inputs (``calibration``, whose losses the race gave), with ``held_out`` the mapping's and each
    layer's error there, and AWQ then GPTQ's errors (``measure_gptq``, ``step`` picks at a time)."""

    def __init__(
        self,
        calibration: Side,
        held_out: Side | None,
        remake: Callable[[list[Candidate]], Iterator[list[Candidate]]],
        step: int,
    ) -> None:
        self.calibration, self.held_out, self.remake, self.step = calibration, held_out, remake, step
        self.gptq: dict[tuple, float] = {}
        self.gptq_held_out: dict[tuple, float] = {}

    def measure(self, picked: list[Candidate]) -> None:
        distinct = list({candidates.digest(c): c for c in picked}.values())
        for made in self.remake(distinct):
            self.calibration.measure(made, losses=False)
            if self.held_out is not None:
                self.held_out.measure(made, losses=True)

    def measure_gptq(
        self,
        kept: dict[tuple, tuple[Candidate, dict]],
        weights: dict[str, torch.Tensor],
        spec: ob.QuantSpec,
        gptq: ob.GPTQSpec,
    ) -> None:
        """AWQ then GPTQ (``then_gptq``) of every kept pick, ``step`` at a time (the picks sharing
        scales, and so GPTQ's factors, together): the parent's error on the calibration and
        held-out inputs."""
        keys = sorted(kept, key=lambda key: candidates.scales_key(kept[key][0].scales))
        moment = self.calibration.inputs.moment
        for start in range(0, len(keys), self.step):
            chunk = {key: kept[key] for key in keys[start : start + self.step]}
            made = then_gptq.gptq_candidates(weights, chunk, moment, spec, gptq)
            if not made:
                continue
            for side, into in ((self.calibration, self.gptq), (self.held_out, self.gptq_held_out)):
                if side is not None:
                    losses = side.judged(list(made.values()))
                    into.update({key: side.relative(loss) for key, loss in zip(made, losses, strict=True)})
