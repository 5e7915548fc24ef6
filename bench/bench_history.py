"""The team's run history (issue 40): what keeping a run costs, and what opening it saves.

For each run, computed once in this process (``SessionRun.compute``, a fresh result cache, as a
server's first asker computes it): ``keep`` is ``History.record`` (the run directory, its lab JSON,
the index row), ``open`` is ``History.open`` as a colleague's link or a restarted server reads it,
each the median of the repeats (a new history each time), against the run's own compute time.
The agreement column says whether the opened run's error table is the computed one's (every
observer's every metric, as served and per layer) and what the run takes on disk.
- MiniLM demo: the Overview's one-click demo (6 layers, int4 g128 weights, int8 inputs, every
  observer that applies);
- tiny-llama NVFP4: block 0's seven layers, weights and inputs, with GPTQ (its Hessians are kept).

    python -m bench --only history
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import observers as ob
from bench.common import case, median_seconds
from lab import results
from lab.analyse.result_cache import ResultCache
from lab.history.run_file import KeptRun
from lab.history.store import History
from lab.serve.session_runs import SessionRun
from lab.settings import RunSettings, SpecSettings, default_layer_names
from lab.workspace import DEMO_LAYERS
from sample_models import open_model

MB = 1e6


def _runs() -> dict[str, tuple[object, list[str], RunSettings]]:
    minilm = open_model("minilm")
    demo = RunSettings(
        weight=SpecSettings(dtype="int4", strategy="group", group_size=128), act=SpecSettings(dtype="int8")
    )
    llama = open_model("tiny-llama")
    block = [info.name for info in llama.layers() if info.name.startswith("model.layers.0.") and len(info.shape) == 2]
    nvfp4 = RunSettings(weight=SpecSettings(dtype="nvfp4"), act=SpecSettings(dtype="nvfp4"), gptq=ob.GPTQSpec())
    return {
        f"MiniLM demo ({DEMO_LAYERS} layers, int4 g128 + int8 inputs, every observer)": (
            minilm,
            default_layer_names(minilm.layers())[:DEMO_LAYERS],
            demo,
        ),
        f"tiny-llama NVFP4 block 0 ({len(block)} layers, weights + inputs, GPTQ)": (llama, block, nvfp4),
    }


def cases(device: str = "cpu") -> list[dict]:
    return [row for name, run in _runs().items() for row in _rows(name, *run, device)]


def _rows(name: str, model: object, layers: list[str], settings: RunSettings, device: str) -> list[dict]:
    config = settings.config(has_layers=True, has_attention=False)
    start = time.perf_counter()
    computed = SessionRun(model, layers, config, [], ResultCache(), {}).compute()
    compute_s = time.perf_counter() - start
    run = KeptRun(computed.analysis, request={"source": str(model.source)})
    with tempfile.TemporaryDirectory() as folder:
        fresh = (History(Path(folder) / str(i), 10) for i in range(1000))  # a new history per keep
        keep_s = median_seconds(lambda: next(fresh).record(run, "bench"), device)
        history = History(Path(folder) / "kept", 10)
        record = history.record(run, "bench")
        open_s = median_seconds(lambda: history.open(record.id, model.weight), device)
        opened = history.open(record.id, model.weight).analysis
        same = results.error_table(opened).equals(results.error_table(computed.analysis))
    return [
        case(
            f"history: keep a run, {name}",
            keep_s,
            compute_s,
            "computing the run",
            agreement=f"{record.size / MB:.1f} MB on disk",
        ),
        case(
            f"history: open a kept run, {name}",
            open_s,
            compute_s,
            "computing the run",
            agreement=f"same error table: {'yes' if same else 'NO'}",
        ),
    ]
