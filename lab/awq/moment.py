"""The second moment of a balance layer's inputs, ``M = mean x xᵀ``, held in the smaller of its two
forms (issue 54).

An AWQ search reads ``M`` for its figures (each layer's output error ``tr(Δ M Δᵀ)``), its clip
search (``M``'s diagonal blocks), the importance an observer takes (its diagonal), a linear
parent's loss (``LinearCalls``) and AWQ then GPTQ (its Hessian). A 7B-wide ``down_proj`` has 11008
input columns: ``M`` is 970 MB in float64 and one calibration batch's ``xᵀx`` as large again, while
the 4096 calibration tokens themselves are 180 MB. So while the tokens are fewer than the columns
they are kept as they came (``tokens`` form) and every figure is computed from them; once they
outnumber the columns the float64 sum ``Σ xᵀx`` is kept instead (``sum`` form), batch by batch in
the order they came, exactly as before: its figures are bit for bit what they were. The full
matrix is made from the tokens only when asked for (AWQ then GPTQ), by the same per-batch sums.
"""

from __future__ import annotations

import torch

import observers as ob


class InputMoment:
    """``mean x xᵀ`` over the rows ``add`` is given, ``columns`` wide."""

    def __init__(self, columns: int) -> None:
        self.columns = columns
        self.count = 0
        self._rows: list[torch.Tensor] = []
        self._sum: torch.Tensor | None = None
        self._divided = False
        self._hessian: torch.Tensor | None = None
        self._blocks: dict[int, torch.Tensor] = {}
        self._diagonal: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: torch.Tensor) -> InputMoment:
        """The moment of ``rows`` ``(tokens, columns)`` taken as one batch."""
        found = cls(rows.shape[-1])
        found.add(rows)
        return found

    @classmethod
    def of_matrix(cls, matrix: torch.Tensor, count: int) -> InputMoment:
        """A moment given as its mean ``(columns, columns)`` over ``count`` tokens (``sum`` form)."""
        found = cls(matrix.shape[0])
        found.count, found._sum, found._divided = count, matrix.double().clone(), True
        return found

    @property
    def held_as_tokens(self) -> bool:
        """Whether the tokens themselves are held (fewer than the columns)."""
        return self._sum is None

    def add(self, rows: torch.Tensor) -> None:
        """One batch's rows ``(tokens, columns)``: kept while the tokens are fewer than the columns
        (as given, not copied: a caller hands rows nothing writes to again, such as a view of a
        parent's recorded input), else summed into ``Σ x xᵀ`` (float64, in the order the batches
        came)."""
        if self._divided:
            raise ValueError("an input moment takes no rows once it has been read")
        rows = rows.detach().reshape(-1, self.columns)
        self.count += rows.shape[0]
        if self._sum is None and self.count <= self.columns:
            self._rows.append(rows)
            return
        if self._sum is None:
            self._sum = self._summed()
            self._rows = []
        wide = rows.double()
        self._sum.add_(wide.T @ wide)

    def _summed(self) -> torch.Tensor:
        """``Σ x xᵀ`` of the kept rows, batch by batch in order (float64)."""
        total = torch.zeros(self.columns, self.columns, dtype=torch.float64, device=self._device())
        for rows in self._rows:
            wide = rows.double()
            total.add_(wide.T @ wide)
        return total

    def _device(self) -> torch.device:
        return self._rows[0].device if self._rows else torch.device("cpu")

    def full(self) -> torch.Tensor:
        """The ``(columns, columns)`` float64 mean: the sum divided in place once (no rows are
        taken after), or made anew from the tokens when they are held."""
        if self._sum is None:
            return self._summed() / max(self.count, 1)
        if not self._divided:
            self._sum.div_(max(self.count, 1))
            self._divided = True
        return self._sum

    def diagonal(self) -> torch.Tensor:
        """The mean square per column (float64, ``(columns,)``; made once)."""
        if self._diagonal is None:
            self._diagonal = self._diagonal_of()
        return self._diagonal

    def _diagonal_of(self) -> torch.Tensor:
        if self._sum is not None:
            return self.full().diagonal().clone()
        total = torch.zeros(self.columns, dtype=torch.float64, device=self._device())
        for rows in self._rows:
            total += rows.double().square().sum(0)
        return total / max(self.count, 1)

    def blocks(self, size: int) -> torch.Tensor:
        """The ``(columns/size, size, size)`` float64 diagonal blocks (made once per size)."""
        if size not in self._blocks:
            self._blocks[size] = self._blocks_of(size)
        return self._blocks[size]

    def _blocks_of(self, size: int) -> torch.Tensor:
        groups = self.columns // size
        if self._sum is not None:
            whole = self.full()
            return whole.reshape(groups, size, groups, size).diagonal(dim1=0, dim2=2).permute(2, 0, 1).clone()
        total = torch.zeros(groups, size, size, dtype=torch.float64, device=self._device())
        for rows in self._rows:
            grouped = rows.double().reshape(-1, groups, size).transpose(0, 1)
            total += grouped.transpose(1, 2) @ grouped
        return total / max(self.count, 1)

    def energy(self, weight: torch.Tensor) -> float:
        """``‖W x‖²`` averaged over the tokens (``tr(W M Wᵀ)``): a layer error's reference."""
        if self._sum is not None:
            return ob.output_energy(weight, self._float())
        return self._mean_square(weight)

    def layer_error(self, weight: torch.Tensor, approx: torch.Tensor, energy: float) -> float:
        """Relative ``‖W x − Ŵ x‖² / ‖W x‖²`` over the tokens (``energy``: ``energy(weight)``), as
        ``ob.layer_output_error`` computes it from ``M`` (0 when both are 0)."""
        if self._sum is not None:
            return ob.layer_output_error(weight, approx, self._float(), energy)
        error = self._mean_square(weight.float() - approx.reshape(weight.shape).float())
        if energy > 0:
            return error / energy
        return 0.0 if error == 0 else float("inf")

    def _float(self) -> torch.Tensor:
        if self._hessian is None:
            self._hessian = self.full().float()
        return self._hessian

    def _mean_square(self, matrix: torch.Tensor) -> float:
        """``Σ‖matrix · x‖² / count`` over the held tokens (float32 products, float64 sums)."""
        m = matrix.reshape(matrix.shape[0], -1).float()
        total = 0.0
        for rows in self._rows:
            total += float((rows.float() @ m.T).square().sum(dtype=torch.float64))
        return total / max(self.count, 1)
