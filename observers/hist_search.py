"""Vectorized searches over a ``RowHistogram``: L2 range search, quantiles, KL (entropy) search.

Everything works in "bin units" (bin ``b`` spans ``[b, b + 1)``) with the density uniform inside
each bin, on all rows at once, with prefix sums over bins instead of Python loops over bins or
candidates. The observers run a search on chunks of rows (``in_row_chunks``) so its working set
stays within ``SEARCH_CHUNK_BYTES`` whatever the number of channels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from observers.hist_state import RowHistogram
from observers.pick import first_least

SEARCH_CHUNK_BYTES = 1 << 22
"""Bytes of working tensors one chunk of rows of a histogram search may hold (each search states
its bytes per row). A per-channel search's tensors grow with rows x candidates x bins: in one
piece, entropy held 10 MB a row (every candidate's runs), a 7B gate_proj's 11008 channels 100 GB;
the L2 search 0.35 MB a row, the ``mse`` sweep 47 MB a row (every candidate's fake-quantized bin
centres). The rows' searches are independent, so chunks change no number, only the peak. 4 MiB:
a chunk stays in a large L2 or the L3 cache, where these ten-pass elementwise searches run 3x
faster than from memory (the ``mse`` sweep: 16 ms a 2048-bin row at 0.5-2 MiB, 28 ms at 16 MiB,
45 ms at 64 MiB, one thread), and the per-chunk cost of Python (~0.1 ms) stays small."""


def chunk_budget(cap: int | None = None) -> int:
    """Bytes one chunk of a search may hold: ``SEARCH_CHUNK_BYTES``, or a smaller ``cap`` (an
    observer's own ``max_working_bytes``)."""
    return SEARCH_CHUNK_BYTES if cap is None else min(cap, SEARCH_CHUNK_BYTES)


def row_chunks(rows: int, bytes_per_row: int, cap: int | None = None) -> list[slice]:
    """Consecutive slices of ``rows`` rows, each as many as fit ``chunk_budget(cap)`` at
    ``bytes_per_row``, at least one (no rows: one empty chunk, so the search still runs once)."""
    size = max(1, chunk_budget(cap) // max(1, bytes_per_row))
    return [slice(first, first + size) for first in range(0, max(rows, 1), size)]


def in_row_chunks(
    hist: RowHistogram,
    bytes_per_row: int,
    search: Callable[[RowHistogram], tuple[torch.Tensor, ...]],
    cap: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """``search``'s tensors (each with one entry per row first) for every row of ``hist``, run on
    the chunks of ``row_chunks`` and put back together: equal to one search over all rows, since
    each row's search reads only its own row, with one chunk's working set alive at a time.

    Each chunk's results are copied into tensors allocated once: thousands of small results kept
    between a chunk's megabyte-sized temporaries pinned the allocator's heap (glibc reuses freed
    space only around live blocks) and the process grew by a chunk per chunk (2.4 GB in one
    ``mse`` search of 151 rows at 16 MiB, measured)."""
    rows = hist.counts.shape[0]
    results: tuple[torch.Tensor, ...] = ()
    for part in row_chunks(rows, bytes_per_row, cap):
        found = search(hist.rows(part))
        if not results:
            results = tuple(t.new_empty((rows, *t.shape[1:])) for t in found)
        for whole, piece in zip(results, found, strict=True):
            whole[part] = piece
    return results


PAIR_BUDGET = 1 << 22
"""Bounds the exact-error polish of the L2 search (cells per round ~ 4x this)."""
SERIAL_ELEMENTS = 1 << 15
"""Working-tensor size of the one-row searches: torch runs an op on fewer elements than its grain
size (32768) on the calling thread. Forking at this size saves about what it costs, and a worker
whose core another process holds stalls every op: MiniLM's 12 one-row L2 searches took 0.3-3.8 s
on 2 threads of a shared 2-core machine with tensors 2-8x larger, 55 ms on one thread."""


def _prefix_moments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefix sums (R, bins + 1) of ``∫ x^k ρ(x) dx`` over whole bins, k = 0, 1, 2."""
    bins = counts.shape[1]
    b = torch.arange(bins, dtype=torch.float64, device=counts.device)
    pad = lambda t: torch.nn.functional.pad(torch.cumsum(t, dim=1), (1, 0))  # noqa: E731
    return pad(counts), pad(counts * (b + 0.5)), pad(counts * (b * b + b + 1.0 / 3.0))


def _edge_terms(moments) -> torch.Tensor:
    """Per-edge coefficients (6, R, bins + 1) of the screening estimate (see ``_screen_pairs``).

    With ``u = (end - start) / (2·levels)`` (half a step), the estimate for ``[start, end)`` is
    ``α(start) + γ(end) + u·(β(start) + δ(end)) + u²·(ε(start) + ζ(end))``: the mass left of
    ``start`` is charged its squared distance to the first level ``start + u``, the mass right of
    ``end`` its distance to ``end - u``, the mass inside ``(2u)²/12``. Every term is a sum of
    non-negative parts, so fp32 is accurate enough for the screen.
    """
    p0, p1, p2 = moments
    edge = torch.arange(p0.shape[1], dtype=torch.float64, device=p0.device)
    total0, total1, total2 = p0[:, -1:], p1[:, -1:], p2[:, -1:]
    r0, r1, r2 = total0 - p0, total1 - p1, total2 - p2
    alpha = p2 - 2 * edge * p1 + edge * edge * p0
    beta = -2 * (p1 - edge * p0)
    gamma = r2 - 2 * edge * r1 + edge * edge * r0
    delta = 2 * (r1 - edge * r0)
    epsilon = 2.0 / 3.0 * p0
    zeta = total0 - 2.0 / 3.0 * p0
    return torch.stack([alpha, beta, epsilon, gamma, delta, zeta]).float()


def _combine(at_start: torch.Tensor, at_end: torch.Tensor, half_step: torch.Tensor) -> torch.Tensor:
    alpha, beta, epsilon = at_start
    gamma, delta, zeta = at_end
    return alpha + gamma + half_step * ((beta + delta) + half_step * (epsilon + zeta))


def _screen_pairs(terms: torch.Tensor, start: torch.Tensor, end: torch.Tensor, levels: int) -> torch.Tensor:
    """Screening L2 estimate for ranges ``[start, end)`` (bin edges, (R, P) fp64); ``inf`` if invalid."""
    bins = terms.shape[2] - 1
    valid = (start >= 0) & (end <= bins) & (end > start)
    s_idx, e_idx = start.clamp(0, bins).long(), end.clamp(0, bins).long()
    at_start = torch.stack([torch.gather(t, 1, s_idx) for t in terms[:3]])
    at_end = torch.stack([torch.gather(t, 1, e_idx) for t in terms[3:]])
    half_step = ((end - start) / (2 * levels)).float()
    return torch.where(valid, _combine(at_start, at_end, half_step), torch.inf)


@functools.lru_cache(maxsize=16)
def _grid_blocks(
    step: int, bins: int, levels: int, rows: int, chunk_elements: int, device: torch.device
) -> tuple[torch.Tensor, tuple[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor], ...]]:
    """The grid's edges (E,) fp64 and, per block of starts ``[first, last)`` (about
    ``chunk_elements`` scores for ``rows`` rows) scored against every edge after ``first``: the
    half steps (1, b, E') fp32 of those pairs and the cells (rows, columns) whose end is not after
    their start. They depend on the shapes and the levels only, so every histogram of one shape
    shares them (a third of the screen's time on MiniLM's one-row searches)."""
    edges = _grid_edges(step, bins, device).double()
    count = edges.numel()
    block = max(1, chunk_elements // max(1, rows * count))
    blocks = []
    for first in range(0, count - 1, block):
        last = min(count - 1, first + block)
        half_step = ((edges[first + 1 :].view(1, 1, -1) - edges[first:last].view(1, -1, 1)) / (2 * levels)).float()
        empty = torch.nonzero(half_step[0] <= 0, as_tuple=True)
        blocks.append((first, last, half_step, *empty))
    return edges, tuple(blocks)


def _screen_grid(
    terms: torch.Tensor, step: int, levels: int, chunk_elements: int = SERIAL_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All pairs of the grid of every ``step``-th edge: (edges (E,), best score per start (R, E),
    its end (R, E)).

    Blocks of starts are scored against every later edge by broadcasting, in place, in blocks
    small enough to stay in cache (``chunk_elements`` scores at a time); a block's starts skip
    the edges before its first start, so small blocks also skip most of the invalid half.
    """
    rows, bins = terms.shape[1], terms.shape[2] - 1
    edges, blocks = _grid_blocks(step, bins, levels, rows, chunk_elements, terms.device)
    count = edges.numel()
    index = edges.long()
    at_start_all = terms[:3, :, index]
    at_end_all = terms[3:, :, index]
    best = torch.full((rows, count), torch.inf, device=terms.device)
    best_end = torch.full((rows, count), float(edges[-1]), dtype=torch.float64, device=terms.device)
    for first, last, half_step, empty_start, empty_end in blocks:
        alpha, beta, epsilon = (t[:, first:last].unsqueeze(2) for t in at_start_all)
        gamma, delta, zeta = (t[:, first + 1 :].unsqueeze(1) for t in at_end_all)
        score = (epsilon + zeta).mul_(half_step).add_(beta).add_(delta).mul_(half_step).add_(alpha).add_(gamma)
        score[:, empty_start, empty_end] = torch.inf
        value, which = score.min(dim=2)
        best[:, first:last] = value
        best_end[:, first:last] = edges[first + 1 :][which]
    return edges, best, best_end


def exact_l2(counts: torch.Tensor, moments, start: torch.Tensor, end: torch.Tensor, levels: int) -> torch.Tensor:
    """Expected squared error (bin units²) of a ``levels``-level uniform quantizer on ``[start, end)``.

    The quantizer is torch.ao's model: ``levels`` equal cells over the range, each value goes to
    its cell's centre, values beyond the range to the first/last centre. ``start``/``end`` (R, K).

    Summation by parts over the cells (centres ``c_j``, inner bounds ``b_j = (c_(j-1) + c_j) / 2``
    a step apart) gives the error of every value at the last centre ``c`` plus
    ``2·step·Σ_j h(b_j)`` with ``h(t) = ∫_0^t x ρ - t·∫_0^t ρ = P1[k] - t·P0[k] - counts[k]·(t - k)²/2``
    (``k = floor t``, density uniform inside a bin): per bound two prefix sums and a count, no
    second moment and no per-cell differences.
    """
    p0, p1, p2 = moments
    rows, bins = counts.shape
    step = (end - start) / levels
    last = end - 0.5 * step
    at_last = p2[:, -1:] - 2 * last * p1[:, -1:] + last * last * p0[:, -1:]
    j = torch.arange(1, levels, dtype=torch.float64, device=counts.device)
    t = torch.addcmul(start.unsqueeze(-1), j, step.unsqueeze(-1))  # inner bounds (R, K, levels - 1)
    k = t.floor().clamp_(0, bins - 1)
    index = k.long().view(rows, -1)
    at = lambda table: torch.gather(table, 1, index).view(t.shape)  # noqa: E731
    inside = (t - k).square_().mul_(at(counts * 0.5))
    h = at(p1).sub_(t.mul_(at(p0))).sub_(inside)
    return at_last + 2 * step * h.sum(dim=-1)


def _exact_l2_chunked(counts, moments, start: torch.Tensor, end: torch.Tensor, levels: int) -> torch.Tensor:
    """``exact_l2`` over the candidates (R, K) in column chunks of about ``SERIAL_ELEMENTS``
    cells (at least one column), so a one-row search stays on the calling thread (each
    candidate's error is computed alike in any chunk)."""
    columns = max(1, SERIAL_ELEMENTS // (counts.shape[0] * max(1, levels - 1)))
    parts = [
        exact_l2(counts, moments, start[:, first : first + columns], end[:, first : first + columns], levels)
        for first in range(0, start.shape[1], columns)
    ]
    return torch.cat(parts, dim=1)


def _grid_edges(step: int, bins: int, device: torch.device) -> torch.Tensor:
    edges = torch.arange(0, bins + 1, step, device=device)
    if int(edges[-1]) != bins:
        edges = torch.cat([edges, torch.tensor([bins], device=device)])
    return edges


def _window_pairs(start, end, radius: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(-radius, radius + 1, step, dtype=torch.float64, device=start.device)
    ds, de = torch.meshgrid(offsets, offsets, indexing="ij")
    return start.unsqueeze(1) + ds.reshape(1, -1), end.unsqueeze(1) + de.reshape(1, -1)


SCREEN_PAIRS = 1 << 18
"""Most pairs per round of the coarse-to-fine screen: 2048 bins start on a grid of every 4th edge."""


def _first_step(rows: int, bins: int) -> int:
    """Smallest power-of-two grid step whose all-pairs family fits ``SCREEN_PAIRS`` for ``rows`` rows."""
    step = 1
    while step < bins and rows * ((bins // step + 2) ** 2) // 2 > SCREEN_PAIRS:
        step *= 2
    return step


def l2_row_bytes(bins: int) -> int:
    """Working bytes per row of ``l2_range_search`` at its peak: the prefix moments and the edge
    terms, about 24 fp64 rows of ``bins + 1`` (measured: 0.35 MB a row at 2048 bins)."""
    return 192 * (bins + 1)


def l2_range_search(
    hist: RowHistogram, levels: int, exact_top: int = 64, apart: int = 1, whole_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the histogram range ``[start, end)`` (bin edges) with the least L2 quantization error.

    All pairs on a coarse grid of edges (``_first_step``: every 4th edge for one 2048-bin row),
    then windows around each row's best at finer steps (8x finer each round, down to 1), scored
    with prefix sums (``_screen_pairs``), so the pairs per row stay bounded. ``apart``: the rows
    are that many weights' stacked, the grid the one each weight's rows get alone.
    The ``exact_top`` best pairs of each row are then re-scored with the
    exact error (``exact_l2``) and the best is kept. ``whole_rows``: ``hist`` is a chunk of a
    search over that many rows (``in_row_chunks``), whose grid and polish window it keeps, so
    each row gets the range the whole search gives it.
    """
    counts = hist.counts
    rows, bins = counts.shape
    whole_rows = rows if whole_rows is None else whole_rows
    moments = _prefix_moments(counts)
    terms = _edge_terms(moments)
    step = _first_step(whole_rows // apart, bins)
    edges, score, end = _screen_grid(terms, step, levels)
    start = edges.unsqueeze(0).expand(rows, -1)
    while step > 1:
        best = first_least(score, 1, keepdim=True)
        radius, step = step, max(1, step // 8)
        start, end = _window_pairs(start.gather(1, best).squeeze(1), end.gather(1, best).squeeze(1), radius, step)
        score = _screen_pairs(terms, start, end, levels)
    top = min(exact_top, score.shape[1])
    top_idx = score.topk(top, dim=1, largest=False).indices
    top_start, top_end = start.gather(1, top_idx), end.gather(1, top_idx)
    exact = _exact_l2_chunked(counts, moments, top_start, top_end, levels)
    exact = torch.where(torch.isfinite(score.gather(1, top_idx)), exact, torch.inf)
    pick = first_least(exact, 1, keepdim=True)
    best_start, best_end = top_start.gather(1, pick).squeeze(1), top_end.gather(1, pick).squeeze(1)
    error = exact.gather(1, pick).squeeze(1)
    return _refine_exact(counts, moments, best_start, best_end, error, levels, _polish_radius(whole_rows, levels))


def _exact_where(counts, moments, start: torch.Tensor, end: torch.Tensor, wanted: torch.Tensor, levels: int):
    """``exact_l2`` of the candidates (R, W) marked ``wanted``, ``inf`` for the others, which are
    not scored: each row's wanted candidates are packed to the front (in order) first."""
    kept = wanted.sum(dim=1)
    width = int(kept.max()) if kept.numel() else 0
    out = torch.full(start.shape, torch.inf, dtype=torch.float64, device=start.device)
    if width == 0:
        return out
    order = torch.argsort((~wanted).to(torch.uint8), dim=1, stable=True)[:, :width]
    exact = _exact_l2_chunked(counts, moments, start.gather(1, order), end.gather(1, order), levels)
    real = torch.arange(width, device=start.device) < kept.unsqueeze(1)
    return out.scatter_(1, order, torch.where(real, exact, torch.inf))


def _polish_radius(rows: int, levels: int) -> int:
    """Half-width of ``_refine_exact``'s window: it shrinks with the number of rows so each round
    scores at most ~``PAIR_BUDGET · 4`` cells."""
    radius = 1
    while radius < 8 and rows * (2 * radius + 3) ** 2 * (levels + 1) <= 4 * PAIR_BUDGET:
        radius += 1
    return radius


def _refine_exact(counts, moments, start, end, error, levels: int, radius: int, max_rounds: int = 8):
    """Exact-error descent: move both ends within a window (``radius``) around each row's best,
    a few rounds.

    The screen's rounding-noise estimate misjudges spiky histograms (e.g. many exact zeros);
    this polishes its pick with the exact error. A round scores only the candidates no
    earlier window held: those all had an error at least the current best's, so they can be
    neither the new best nor an improvement (the same picks as rescoring the whole window).
    """
    bins = counts.shape[1]
    old_start = old_end = start.unsqueeze(1)[:, :0]  # (R, rounds so far): earlier windows' centres
    for _ in range(max_rounds):
        cand_start, cand_end = _window_pairs(start, end, radius, 1)
        seen = ((cand_start.unsqueeze(2) - old_start.unsqueeze(1)).abs_() <= radius) & (
            (cand_end.unsqueeze(2) - old_end.unsqueeze(1)).abs_() <= radius
        )
        wanted = (cand_start >= 0) & (cand_end <= bins) & (cand_end > cand_start) & ~seen.any(dim=2)
        exact = _exact_where(counts, moments, cand_start, cand_end, wanted, levels)
        value, pick = exact.min(dim=1)
        better = value < error
        if not bool(better.any()):
            break
        old_start, old_end = torch.cat([old_start, start.unsqueeze(1)], 1), torch.cat([old_end, end.unsqueeze(1)], 1)
        start = torch.where(better, cand_start.gather(1, pick.unsqueeze(1)).squeeze(1), start)
        end = torch.where(better, cand_end.gather(1, pick.unsqueeze(1)).squeeze(1), end)
        error = torch.where(better, value, error)
    return start, end


def value_at_ranks(hist: RowHistogram, ranks: torch.Tensor) -> torch.Tensor:
    """Estimated value of the element of 0-based rank ``ranks`` (R, K) in each row.

    The ``c`` elements of a bin are taken to sit at the midpoints of ``c`` equal slots of the
    bin, so each estimate lies inside the bin that holds that element.
    """
    counts = hist.counts
    cdf = torch.cumsum(counts, dim=1)
    before = cdf - counts
    ranks = ranks.double()
    b = torch.searchsorted(cdf.contiguous(), ranks.contiguous(), right=True).clamp_(max=counts.shape[1] - 1)
    inside = torch.gather(counts, 1, b)
    offset = (ranks - torch.gather(before, 1, b) + 0.5) / inside.clamp(min=1.0)
    position = b.double() + offset.clamp(0.0, 1.0)
    return hist.lo.unsqueeze(1) + position * hist.width.unsqueeze(1)


def quantile_row_bytes(bins: int) -> int:
    """Working bytes per row of ``quantile``: the cumulative counts and their shifted copy, fp64."""
    return 32 * bins


def quantile(hist: RowHistogram, q: torch.Tensor) -> torch.Tensor:
    """Quantiles ``q`` (K,) in [0, 1] of each row, (R, K), with ``torch.quantile``'s linear rule.

    Rank ``q·(n - 1)`` is interpolated between its two neighbouring order statistics, each located
    by ``value_at_ranks``; so the estimate is within one bin width of the exact quantile.
    """
    total = hist.counts.sum(dim=1, keepdim=True)
    rank = q.double().unsqueeze(0) * (total - 1)
    low = rank.floor()
    v_low, v_high = value_at_ranks(hist, torch.cat([low, rank.ceil()], dim=1)).chunk(2, dim=1)
    return v_low + (rank - low) * (v_high - v_low)


KL_BYTES_PER_RUN = 48
"""Bytes per row, candidate and run of ``kl_divergences``'s run tables: about six fp64 tensors
(gathered prefix sums, run totals, non-empty counts, levels and their logs)."""


def kl_row_bytes(bins: int, quant_bins: int, start_bin: int, stride: int) -> int:
    """Working bytes per row of ``kl_divergences`` outside its blocks of candidates: the prefix
    sums (fp64, ``bins + 1``), about eight fp64 values per candidate, and one candidate's runs."""
    candidates = len(range(start_bin, bins + 1, stride))
    return 8 * (4 * (bins + 1) + 8 * candidates) + KL_BYTES_PER_RUN * (quant_bins + 1)


@functools.lru_cache(maxsize=16)
def _kl_runs(
    bins: int, quant_bins: int, start_bin: int, stride: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidates (C,), the first source bin of each of their runs and of the run after the
    last (C, quant_bins + 1), and the run holding each candidate's last bin (C,). They depend on
    the shapes only, so every chunk of rows shares them."""
    cand = torch.arange(start_bin, bins + 1, stride, device=device)
    j = torch.arange(quant_bins + 1, device=device)
    # Run j covers source bins [ceil(j·i/qb), ceil((j+1)·i/qb)).
    edges = (j.unsqueeze(0) * cand.unsqueeze(1) + quant_bins - 1) // quant_bins
    last_run = ((cand - 1) * quant_bins) // cand
    return cand, edges, last_run


def _run_levels(pc: torch.Tensor, pn: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and candidate (``edges`` (c, quant_bins + 1)): each run's total (R, c, quant_bins)
    from the prefix sums of counts ``pc``, and the log of its level, the total over its non-empty
    bins (prefix sums ``pn``), 0 for an empty run."""
    rows = pc.shape[0]
    flat = edges.reshape(1, -1).expand(rows, -1)
    at = lambda p: torch.gather(p, 1, flat).reshape(rows, *edges.shape)  # noqa: E731
    run_sum, run_nonzero = at(pc).diff(dim=-1), at(pn).diff(dim=-1)
    level = run_sum / run_nonzero.clamp(min=1.0)
    return run_sum, torch.where(run_sum > 0, torch.log(level.clamp(min=1e-300)), 0.0)


def kl_divergences(
    counts: torch.Tensor, quant_bins: int, start_bin: int, stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(P‖Q) of TensorRT/ModelOpt's entropy calibration for every candidate end bin, all rows at once.

    For candidate ``i`` (``start_bin .. bins`` by ``stride``): ``P = counts[:i]`` with the clipped
    tail added to its last bin; ``Q`` merges ``counts[:i]`` into ``quant_bins`` equal runs
    (source bin ``b`` goes to run ``floor(b·quant_bins / i)``) and spreads each run's total evenly
    over its non-empty bins (runs may be empty when ``i < quant_bins``). ``Σ P log(P/Q)`` is
    computed per run from prefix sums of ``c``, ``c·log c`` and of the non-empty indicator, so the
    cost is O(quant_bins) per candidate. The runs' tables are built for blocks of candidates
    within ``chunk_budget()`` (each candidate's divergence reads only its own runs); the rest is
    ``kl_row_bytes`` a row.
    Returns (candidates (C,), divergences (R, C)); ``inf`` where P has mass that Q lacks.
    """
    rows, bins = counts.shape
    cand, edges, last_run = _kl_runs(bins, quant_bins, start_bin, stride, counts.device)
    pad = lambda t: torch.nn.functional.pad(torch.cumsum(t, dim=1), (1, 0))  # noqa: E731
    nonzero = (counts > 0).double()
    c_log_c = torch.where(counts > 0, counts * torch.log(counts.clamp(min=1e-300)), 0.0)
    pc, pn, pl = pad(counts), pad(nonzero), pad(c_log_c)
    count = cand.numel()
    # Σ_b P_b log Q_b run by run, and the log level of the run holding each candidate's last bin.
    run_terms = torch.empty(rows, count, dtype=torch.float64, device=counts.device)
    log_last = torch.empty_like(run_terms)
    block = max(1, chunk_budget() // max(1, rows * (quant_bins + 1) * KL_BYTES_PER_RUN))
    for first in range(0, count, block):
        part = slice(first, first + block)
        run_sum, log_level = _run_levels(pc, pn, edges[part])
        run_terms[:, part] = (run_sum * log_level).sum(dim=-1)
        at_last = last_run[part].view(1, -1, 1).expand(rows, -1, 1)
        log_last[:, part] = torch.gather(log_level, 2, at_last).squeeze(-1)
    total = pc[:, -1:]
    kept = torch.gather(pc, 1, cand.unsqueeze(0).expand(rows, -1))
    tail = total - kept
    last = torch.gather(counts, 1, (cand - 1).unsqueeze(0).expand(rows, -1))
    # Σ_b P_b log P_b: all bins before the last as they are, the last with the tail added.
    p_log_p = torch.gather(pl, 1, (cand - 1).unsqueeze(0).expand(rows, -1))
    last_p = last + tail
    p_log_p = p_log_p + torch.where(last_p > 0, last_p * torch.log(last_p.clamp(min=1e-300)), 0.0)
    # The tail sits in the last bin, which is in the last run.
    p_log_q = run_terms + tail * log_last
    kl = (p_log_p - p_log_q) / total - torch.log(total) + torch.log(kept.clamp(min=1e-300))
    impossible = (last == 0) & (tail > 0) | (kept == 0)
    return cand, torch.where(impossible, torch.inf, kl)
