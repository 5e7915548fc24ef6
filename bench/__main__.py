"""``python -m bench [--device cpu|cuda|auto] [--only SUBSTRING] [--quick] [--threads N] [--markdown FILE]``

Runs every benchmark module's ``cases(device)`` in one process and prints one table: ours
(median of 5 after a warm-up, 2 with ``--quick``), each reference timed in this same process on
the same tensors, the speed-up, ours as a multiple of the memory-bandwidth floor measured in the
same run, and an agreement column so that a speed-up never hides a different answer. A reference
that is not installed is reported as ``missing: <package> not installed``, never faked.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import sys
import traceback

import torch

from bench.common import SETTINGS, version
from observers import kernels

MODULES = [
    "bench_core",
    "bench_distribution",
    "bench_blocks",
    "bench_today",
    "bench_minilm",
    "bench_scaling",
    "bench_capture",
    "bench_sequential",
    "bench_app",
    "bench_sweep",
    "bench_effect",
    "bench_calibration",
    "bench_recipe",
    "bench_float_grid",
    "bench_minilm_nvfp4",
    "bench_serve",
    "bench_gptq",
    "bench_gptq_oneshot",
    "bench_fused_oneshot",
    "bench_allocate",
    "bench_history",
    "bench_awq_oneshot",
    "bench_widths",
]
REFERENCES = ["llmcompressor", "nvidia-modelopt", "amd-quark", "compressed-tensors", "transformers"]


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda asked for, but torch sees no CUDA device")
    return name


def machine_line(device: str) -> str:
    if device == "cuda":
        what = torch.cuda.get_device_name(0)
    else:
        what = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    line = f"{datetime.date.today().isoformat()} · {device} · {what} · torch {torch.__version__}"
    return f"{line} · min-max kernel: {kernels.status()}"


def references_line() -> str:
    """Versions of the reference packages in this environment (what the reference column ran)."""
    return "references: " + " · ".join(f"{name} {version(name)}" for name in REFERENCES)


def ms_cell(seconds: float | None) -> str:
    """Seconds as a millisecond cell ("" for none)."""
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def format_rows(rows: list[dict]) -> list[list[str]]:
    """Table cells per row: times in ms, speed-up = reference / ours, x floor = ours / floor."""
    table = []
    for r in rows:
        ratio = f"{r['reference_s'] / r['ours_s']:.1f}x" if r.get("reference_s") and r["ours_s"] else ""
        floor = f"{r['ours_s'] / r['floor_s']:.1f}x" if r.get("floor_s") else ""
        table.append(
            [
                r["case"],
                ms_cell(r["ours_s"]),
                ms_cell(r.get("reference_s")),
                r.get("reference", ""),
                ratio,
                floor,
                r.get("agreement", ""),
            ]
        )
    return table


HEADER = ["case", "ours ms", "reference ms", "reference", "speed-up", "x floor", "agreement"]


def markdown(rows: list[dict], header: list[str] = HEADER, cells: list[list[str]] | None = None) -> str:
    """The table as GitHub markdown (``|`` in a cell is escaped); ``cells`` overrides the cells
    computed from ``rows`` (for tables with extra columns)."""
    body = format_rows(rows) if cells is None else cells
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def plain(rows: list[dict], header: list[str] = HEADER, cells: list[list[str]] | None = None) -> str:
    """The table as aligned plain text for the terminal."""
    table = [header, *(format_rows(rows) if cells is None else cells)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--only", default="", help="run only modules whose name contains this")
    parser.add_argument("--markdown", default=None, help="also write the table as markdown to this file")
    parser.add_argument("--json", default=None, help="also write the raw rows as JSON (for python -m bench.merge)")
    parser.add_argument("--quick", action="store_true", help="small tensors and 2 repeats (a smoke test, not figures)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    device = _device(args.device)
    SETTINGS.quick = args.quick
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"error: --threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    failed = False
    for name in MODULES:
        if args.only and args.only not in name:
            continue
        print(f"running bench.{name} on {device} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"bench.{name}")
            rows += module.cases(device)
        except Exception:  # noqa: BLE001 - report the failing module and go on with the others
            failed = True
            traceback.print_exc()
            rows.append({"case": f"{name}: FAILED (see stderr)", "ours_s": 0.0, "agreement": "failed"})
    run_line = machine_line(device) + (" · --quick" if args.quick else "")
    print(f"{run_line}\n{references_line()}\n{plain(rows)}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{run_line}  \n{references_line()}\n\n{markdown(rows)}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_line, "references": references_line(), "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
