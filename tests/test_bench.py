"""The benchmark harness: ``python -m bench --quick`` runs, its table is well formed, a reference
that is not installed is reported as missing (never faked), and the helpers compute what they say."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from bench import __main__ as bench_main
from bench import bench_widths as widths
from bench.common import (
    SETTINGS,
    Ref,
    interleaved_medians,
    llm_weight,
    measure,
    reference,
    scales_agree,
)
from bench.merge import main as merge_main
from bench.merge import merge, merged_cells


def _table_rows(markdown: str) -> list[list[str]]:
    """Cells of the markdown table's body rows (after the header and the separator)."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def test_quick_core_run_writes_a_table_with_times_floors_and_missing_references(tmp_path, monkeypatch):
    monkeypatch.setattr(SETTINGS, "quick", False)  # restored after the test; main sets it
    out = tmp_path / "bench.md"
    assert bench_main.main(["--quick", "--only", "core", "--device", "cpu", "--markdown", str(out)]) == 0
    text = out.read_text()
    assert "--quick" in text.splitlines()[0]
    assert text.splitlines()[1].startswith("references: llmcompressor ")
    header = [line for line in text.splitlines() if line.startswith("|")][0]
    assert header == "| " + " | ".join(bench_main.HEADER) + " |"
    rows = _table_rows(text)
    assert len(rows) >= 10
    for cells in rows:
        assert len(cells) == len(bench_main.HEADER)
        assert float(cells[1]) > 0, cells
        assert cells[5].endswith("x") and float(cells[5][:-1]) > 0, cells  # every core case has a floor
    by_reference = {cells[3]: cells for cells in rows}
    lc_rows = [cells for cells in rows if "llm-compressor memoryless_minmax" in cells[3]]
    assert len(lc_rows) == 2  # 4096x4096 and 4096x11008 (their --quick row counts)
    if importlib.util.find_spec("llmcompressor") is None:
        for cells in lc_rows:
            assert cells[3].startswith("missing: llmcompressor not installed")
            assert cells[2] == "" and cells[4] == ""  # no reference time, no speed-up: nothing faked
    else:
        for cells in lc_rows:
            assert float(cells[2]) > 0 and cells[6].startswith("identical scales 100.0000%")
    ao = by_reference["torch.ao PerChannelMinMaxObserver"]
    assert float(ao[2]) > 0 and ao[4].endswith("x")
    assert ao[6] == "identical scales 100.0000%, max rel diff 0.0e+00"
    assert by_reference["compressed-tensors fake_quantize"][6] == "identical"


def test_missing_and_failing_references_are_rows_without_times():
    x = torch.arange(12.0)

    def broken():
        raise RuntimeError("no kernel for this")

    refs = [
        Ref("works", lambda: x * 2, lambda ours, theirs: f"ratio {float(theirs.sum() / ours.sum()):.1f}"),
        Ref("absent", None, missing="missing: somepkg not installed"),
        Ref("breaks", broken),
    ]
    rows = measure("case", lambda: x + 0, x.clone, "cpu", refs)
    assert [r["case"] for r in rows] == ["case"] * 3
    assert all(r["ours_s"] > 0 and r["floor_s"] > 0 for r in rows)
    assert rows[0]["reference_s"] > 0 and rows[0]["agreement"] == "ratio 2.0"
    assert rows[1]["reference_s"] is None and rows[1]["reference"] == "missing: somepkg not installed (absent)"
    assert rows[2]["reference_s"] is None
    assert rows[2]["agreement"] == "reference failed: RuntimeError: no kernel for this"


def test_reference_reports_a_package_that_is_not_installed():
    assert reference("no_such_reference_package_xyz.sub") == "missing: no_such_reference_package_xyz not installed"
    assert reference("math").__name__ == "math"


def test_interleaved_medians_runs_each_function_warmup_plus_repeats_times():
    calls = {"a": 0, "b": 0}

    def bump(name):
        def run():
            calls[name] += 1

        return run

    times = interleaved_medians({"a": bump("a"), "b": bump("b")}, "cpu", repeats=3, warmup=2)
    assert calls == {"a": 5, "b": 5}
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())


def test_format_rows_computes_speed_up_and_floor_multiple():
    rows = [
        {"case": "a", "ours_s": 0.002, "reference_s": 0.005, "reference": "r", "floor_s": 0.0005, "agreement": "ok"},
        {"case": "b", "ours_s": 0.25, "reference_s": None, "reference": "missing: x not installed", "floor_s": None},
    ]
    assert bench_main.format_rows(rows) == [
        ["a", "2.00", "5.00", "r", "2.5x", "4.0x", "ok"],
        ["b", "250.00", "", "missing: x not installed", "", "", ""],
    ]
    md = bench_main.markdown([{**rows[0], "agreement": "a|b"}])
    assert md.splitlines()[2] == "| a | 2.00 | 5.00 | r | 2.5x | 4.0x | a\\|b |"
    plain = bench_main.plain(rows).splitlines()
    assert plain[0].split() == [
        "case",
        "ours",
        "ms",
        "reference",
        "ms",
        "reference",
        "speed-up",
        "x",
        "floor",
        "agreement",
    ]
    assert len({len(line) for line in plain}) == 1  # every column padded to its widest cell
    assert plain[1].index("2.00") == plain[0].index("ours ms") and plain[2].index("250.00") == plain[0].index("ours ms")


def test_scales_agree_counts_identical_scales_and_the_largest_relative_difference():
    ours = torch.tensor([1.0, 2.0, 4.0, 8.0])
    theirs = torch.tensor([1.0, 2.0, 5.0, 8.0])
    naive_same = sum(a == b for a, b in zip(ours.tolist(), theirs.tolist(), strict=True)) / 4
    naive_rel = max(abs(a - b) / abs(b) for a, b in zip(ours.tolist(), theirs.tolist(), strict=True))
    assert scales_agree(ours, theirs) == f"identical scales {naive_same:.4%}, max rel diff {naive_rel:.1e}"
    assert scales_agree(torch.tensor([0.5]), torch.tensor([0.5])) == "scale 0.5 vs 0.5 (rel diff 0.0e+00)"


def test_llm_weight_is_deterministic_with_outlier_channels():
    a, b = llm_weight(64, 256), llm_weight(64, 256)
    assert torch.equal(a, b)
    assert not torch.equal(a, llm_weight(64, 256, seed=1))
    column_absmax = a.abs().amax(dim=0)
    assert int((column_absmax > 10 * column_absmax.median()).sum()) >= 4  # the planted ×20 channels


def test_bad_device_and_thread_count_are_clear_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda asked for, but torch sees no CUDA device"):
        bench_main.main(["--device", "cuda", "--only", "nothing"])
    with pytest.raises(SystemExit, match="--threads must be at least 1"):
        bench_main.main(["--threads", "0", "--only", "nothing"])


def test_merge_keeps_the_fastest_run_per_row_and_the_lowest_reference():
    first = [
        {"case": "a", "ours_s": 0.004, "reference_s": 0.010, "reference": "r", "floor_s": 0.002, "agreement": "slow"},
        {"case": "b", "ours_s": 0.001, "reference_s": None, "reference": "missing: x not installed", "floor_s": None},
    ]
    second = [
        {"case": "a", "ours_s": 0.003, "reference_s": 0.012, "reference": "r", "floor_s": 0.001, "agreement": "fast"},
        {"case": "b", "ours_s": 0.002, "reference_s": None, "reference": "missing: x not installed", "floor_s": None},
    ]
    merged = merge([first, second])
    assert [(r["case"], r["reference"]) for r in merged] == [("a", "r"), ("b", "missing: x not installed")]
    a, b = merged
    assert (a["ours_s"], a["reference_s"], a["floor_s"], a["agreement"]) == (0.003, 0.010, 0.001, "fast")
    assert a["runs_s"] == [0.004, 0.003] and b["ours_s"] == 0.001 and b["reference_s"] is None
    assert merged_cells(merged)[0] == ["a", "3.00", "10.00", "r", "3.3x", "3.0x", "fast", "4.00 / 3.00"]


def test_json_output_round_trips_through_merge(tmp_path, monkeypatch):
    monkeypatch.setattr(SETTINGS, "quick", False)
    runs = []
    for i in range(2):
        path = tmp_path / f"run{i}.json"
        assert bench_main.main(["--quick", "--only", "scaling", "--device", "cpu", "--json", str(path)]) == 0
        runs.append(str(path))
    out = tmp_path / "merged.md"
    assert merge_main([*runs, "--markdown", str(out)]) == 0
    rows = _table_rows(out.read_text())
    assert len(rows) == 8  # 4 observers x 2 sizes in --quick
    for cells in rows:
        per_run = [float(v) for v in cells[7].split(" / ")]
        assert len(per_run) == 2 and float(cells[1]) == min(per_run)
        assert cells[6].endswith("ns/element") and cells[5].endswith("x")


def test_the_clip_pick_case_times_the_kernel_against_its_eager_path_with_the_same_picks():
    from bench.bench_awq_oneshot import clip_pick_rows

    (row,) = clip_pick_rows("cpu")
    assert row["reference"] == "ours, eager path (kernels.disabled())"
    assert row["ours_s"] > 0 and row["reference_s"] > 0
    # the forms are summed in another order than eager's matmul: a group whose two best ratios tie to a
    # few ulps may pick the other (one of 220160 here, where eager's float32 forms are equal and float64
    # says the kernel's is the smaller)
    share = float(row["agreement"].split("%")[0])
    assert share >= 99.99, row["agreement"]


def _widths_result(stage: str, lab, reference=None, note: str = "", hidden: int = 1024) -> widths.StageResult:
    return widths.StageResult(widths.RUNGS[hidden], widths.STAGES[stage], lab, reference, note)


def test_a_process_reports_its_own_peak_rss_not_the_largest_child_so_far(tmp_path):
    allocate = "import sys; block = b'x' * (300 << 20); sys.exit(0)"  # 300 MiB, every page written
    big = widths.measure_process([sys.executable, "-c", allocate], 60, tmp_path / "big.log")
    assert big.ok and big.code == 0 and big.failure == ""
    assert big.peak_bytes >= 300 << 20
    small = widths.measure_process([sys.executable, "-c", "pass"], 60, tmp_path / "small.log")
    # neither the big one's peak (RUSAGE_CHILDREN's maximum) nor this process's own (torch imported: a child
    # forked from it keeps its high-water mark across exec)
    assert small.ok and small.peak_bytes < 100 << 20
    assert big.seconds > 0 and big.cpu_seconds > 0


def test_a_process_past_its_timeout_is_stopped_and_recorded_and_a_failure_keeps_its_last_lines(tmp_path):
    sleeps = [sys.executable, "-c", "import time; time.sleep(120)"]
    stopped = widths.measure_process(sleeps, 1, tmp_path / "sleep.log")
    assert stopped.code is None and not stopped.ok
    assert stopped.cell().startswith("stopped at ") and stopped.cell().endswith(" s")
    fails = "import sys; print('loading'); sys.exit('error: the model has no blocks')"
    failed = widths.measure_process([sys.executable, "-c", fails], 60, tmp_path / "fails.log")
    assert failed.code == 1 and not failed.ok
    assert failed.failure == "loading / error: the model has no blocks"
    assert failed.cell() == "failed (exit 1): loading / error: the model has no blocks"
    absent = widths.measure_process(["no-such-program-in-this-path"], 60, tmp_path / "absent.log")
    assert absent.code == 1 and "FileNotFoundError" in absent.failure


def test_the_projection_sets_the_start_up_apart_and_grows_memory_only_where_blocks_are_held():
    assert widths.project(100.0, 10**9, 10.0, 2, 0) == (10.0 + 45.0 * 32, 10**9)  # lab: one block resident
    assert widths.project(100.0, 10**9, 10.0, 2, 5 * 10**8) == (1450.0, 10**9 + 30 * 5 * 10**8)  # all held
    assert widths.project(50.0, 7, 5.0, 1, 3, target=4) == (5.0 + 45.0 * 4, 7 + 3 * 3)


def test_each_rungs_block_parameters_match_the_decoder_transformers_builds():
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from sample_models.builtin import tiny_llama_config

    for hidden, rung in widths.RUNGS.items():
        config = rung.config()
        shape = (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads)
        assert shape == (hidden, rung.blocks, rung.kv_heads)
        with init_empty_weights():
            block = LlamaForCausalLM(config).model.layers[0]
        assert rung.block_parameters() == sum(p.numel() for p in block.parameters())
        assert hidden % rung.group == 0 and rung.intermediate % rung.group == 0
    assert widths.RUNGS[256].config().to_dict() == tiny_llama_config().to_dict()


def test_the_ladder_table_gives_ratios_differences_and_projections_where_both_sides_ran():
    gb = widths.GB
    lab = widths.Measured(200.0, 390.0, int(3 * gb), 0)
    oneshot = widths.Measured(100.0, 190.0, int(2 * gb), 0)
    results = [
        _widths_result("awq", lab, oneshot),
        _widths_result("weights", lab),
        _widths_result("gptq", widths.Measured(3600.0, 7100.0, int(5 * gb), None), oneshot),
        _widths_result("checkpoint", lab, None, "missing: llmcompressor not installed"),
        _widths_result("checkpoint", lab, widths.Measured(15.0, 14.0, int(gb), 0)),  # shorter than its start-up
    ]
    text = widths.ladder_markdown(results, widths.StartUp(lab=10.0, reference=20.0), "machine line")
    assert text.splitlines()[0] == "machine line  "
    assert "lab 10.0 s, oneshot 20.0 s" in text.splitlines()[1]
    header = next(line for line in text.splitlines() if line.startswith("|"))
    assert header == "| " + " | ".join(widths.HEADER) + " |"
    awq, weights, gptq, checkpoint, short = _table_rows(text)
    assert all(len(row) == len(widths.HEADER) for row in (awq, weights, gptq, checkpoint, short))
    assert awq[0].startswith("hidden 1024 (2 blocks") and awq[1].startswith("AWQ")
    assert awq[2:4] == ["200.0 (CPU 390)", "3.00"]
    assert awq[4] == "oneshot AWQModifier + QuantizationModifier"
    assert awq[5:9] == ["100.0 (CPU 190)", "2.00", "2.00x", "+1.00"]
    # 32 blocks: lab 10 + 95 x 32 s at its measured peak; oneshot 20 + 40 x 32 s, 30 more blocks held
    held = 30 * 4 * results[0].rung.block_parameters() / gb
    assert awq[9] == f"lab 3050 s, 3.00 GB; oneshot 1300 s, {2 + held:.2f} GB; {3050 / 1300:.2f}x, {1 - held:+.2f} GB"
    assert weights[4:9] == ["", "", "", "", ""] and weights[9] == "lab 3050 s, 3.00 GB"
    assert gptq[2] == "stopped at 3600 s" and gptq[3] == "" and gptq[7:] == ["", "", ""]
    assert checkpoint[4].endswith("(missing: llmcompressor not installed)") and checkpoint[5:9] == ["", "", "", ""]
    assert short[7] == "13.33x"
    assert short[9] == "lab 3050 s, 3.00 GB; oneshot: no longer than its start-up, nothing to project"


def test_every_stage_asks_the_lab_cli_for_flags_it_takes(tmp_path):
    from lab.allocate import command as allocate_command
    from lab.cli_args import build_parser

    parser = build_parser(extra=(allocate_command.add_parser,))
    for stage in widths.STAGES:
        args = parser.parse_args(widths.lab_arguments(stage, widths.RUNGS[256], tmp_path / "model", tmp_path, "cpu"))
        assert (args.samples, args.seq_len, args.batch_size, args.sequential) == (32, 128, 1, True)
        if stage == "allocate":
            assert args.schemes == "int4:group:16,FP8,none" and args.kinds == "weight"
            continue
        assert (args.dtype, args.strategy, args.group_size, args.symmetric) == ("int4", "group", 16, True)
        assert args.gptq == (stage == "gptq") and args.propagate == (stage == "gptq")
        assert args.awq == (stage == "awq") and (args.checkpoint is not None) == (stage == "checkpoint")
        assert args.kinds == ("weight,input" if stage == "inputs" else "weight")
    compile(widths.ONESHOT, "oneshot", "exec")  # the reference's script parses


def test_the_ladder_picks_rungs_and_stages_by_name_and_runs_through_python_m_bench(monkeypatch):
    assert widths.parse_rungs("256, 4096") == [256, 4096]
    assert widths.parse_stages("awq,gptq") == ["awq", "gptq"]
    with pytest.raises(ValueError, match="choose from 256, 1024, 2048, 4096"):
        widths.parse_rungs("512")
    with pytest.raises(ValueError, match="choose from weights, inputs"):
        widths.parse_stages("awq,quant")
    assert "bench_widths" in bench_main.MODULES
    asked = {}

    def ladder(rungs, stages, timeout_s, device):
        asked.update(rungs=rungs, stages=stages, timeout_s=timeout_s)
        lab, ref = widths.Measured(12.0, 20.0, int(2e9), 0), widths.Measured(6.0, 10.0, int(1e9), 0)
        return [_widths_result("gptq", lab, ref, hidden=256)], widths.StartUp(2.0, 3.0)

    monkeypatch.setattr(widths, "run_ladder", ladder)
    monkeypatch.setenv("BENCH_WIDTHS_STAGES", "gptq")
    monkeypatch.setenv("BENCH_WIDTHS_TIMEOUT", "900")
    monkeypatch.setattr(SETTINGS, "quick", True)
    (row,) = widths.cases("cpu")
    assert asked == {"rungs": [256], "stages": ["gptq"], "timeout_s": 900.0}
    assert row["case"] == f"widths, {widths.RUNGS[256].label}: GPTQ (run --gptq --propagate)"
    assert (row["ours_s"], row["reference_s"], row["reference"]) == (12.0, 6.0, "oneshot GPTQModifier")
    assert row["agreement"].startswith("peak RSS GB: lab 2.00, oneshot 1.00; 32 blocks (projection): lab ")
