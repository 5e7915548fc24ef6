"""Plotly figures for the app: every figure is built from tensors, QParams and result frames by a
pure function in one of this package's modules (``style``, ``ranges``, ``scales``, ``errors``,
``dynamic``, ``gptq``, ``awq``), so pages stay thin and each figure can be unit-tested on its data.

Figures set no template: the app draws them with ``st.plotly_chart(fig, theme="streamlit")`` so
they follow the light or dark theme. Trace colors are explicit and come from ``observer_color``,
so one observer has the same color on every page.
"""

from lab.results.plots.awq import (
    awq_bars,
)
from lab.results.plots.dynamic import (
    dynamic_scale_figure,
)
from lab.results.plots.errors import (
    ERROR_PAD,
    ERROR_QUANTILE,
    error_bound,
    error_histogram,
    layer_output_bars,
    metric_bars,
    metric_heatmap,
    quantization_error,
)
from lab.results.plots.gptq import (
    gptq_bars,
    gptq_turnover,
    gptq_turnover_summary,
    turned_over,
)
from lab.results.plots.ranges import (
    VIEW_REACH,
    channel_range_figure,
    channel_ranges,
    head_range_figure,
    per_token_view,
    range_histogram,
    range_label,
    tail_bounds,
    token_channel_figure,
    value_histogram,
    view_bounds,
)
from lab.results.plots.scales import (
    MAX_HEATMAP_COLS,
    MAX_HEATMAP_ROWS,
    MIN_DISTRIBUTION_VALUES,
    QPARAM_FIELDS,
    all_equal_note,
    as_grid,
    color_range,
    downsample,
    exponent_grid,
    qparam_heatmaps,
    scale_bars,
    scale_distribution,
    scale_figure_kind,
    scale_ratio_heatmap,
)
from lab.results.plots.style import (
    BAR_PX,
    DATA_COLOR,
    METRIC_LABELS,
    PALETTE,
    legend_on_right,
    legend_on_top,
    observer_color,
    tensor_label,
)

__all__ = [
    "BAR_PX",
    "DATA_COLOR",
    "ERROR_PAD",
    "ERROR_QUANTILE",
    "MAX_HEATMAP_COLS",
    "MAX_HEATMAP_ROWS",
    "METRIC_LABELS",
    "MIN_DISTRIBUTION_VALUES",
    "PALETTE",
    "QPARAM_FIELDS",
    "VIEW_REACH",
    "all_equal_note",
    "as_grid",
    "awq_bars",
    "channel_range_figure",
    "channel_ranges",
    "color_range",
    "downsample",
    "dynamic_scale_figure",
    "error_bound",
    "error_histogram",
    "exponent_grid",
    "gptq_bars",
    "gptq_turnover",
    "gptq_turnover_summary",
    "head_range_figure",
    "layer_output_bars",
    "legend_on_right",
    "legend_on_top",
    "metric_bars",
    "metric_heatmap",
    "observer_color",
    "per_token_view",
    "qparam_heatmaps",
    "quantization_error",
    "range_histogram",
    "range_label",
    "scale_bars",
    "scale_distribution",
    "scale_figure_kind",
    "scale_ratio_heatmap",
    "tail_bounds",
    "tensor_label",
    "token_channel_figure",
    "turned_over",
    "value_histogram",
    "view_bounds",
]
