"""``python -m bench [--device cpu|cuda|auto] [--only SUBSTRING] [--markdown FILE]``

Runs every benchmark module's ``cases(device)`` (plus the scaling curve) in one process and
prints one table: ours (median of >= 5 after warm-up), the reference on the same tensors, the
speed-up, ours as a multiple of the memory-bandwidth floor, and an agreement column so that a
speed-up never hides a different answer. A reference that is not installed is reported as
missing, never faked.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import platform
import sys
import traceback

import torch

MODULES = ["bench_core", "bench_distribution", "bench_blocks", "bench_capture", "bench_app"]


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
    return f"{datetime.date.today().isoformat()} · {device} · {what} · torch {torch.__version__}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def format_rows(rows: list[dict]) -> list[list[str]]:
    table = []
    for r in rows:
        ratio = f"{r['reference_s'] / r['ours_s']:.1f}x" if r.get("reference_s") and r["ours_s"] else ""
        floor = f"{r['ours_s'] / r['floor_s']:.1f}x" if r.get("floor_s") else ""
        table.append(
            [
                r["case"],
                _ms(r["ours_s"]),
                _ms(r.get("reference_s")),
                r.get("reference", ""),
                ratio,
                floor,
                r.get("agreement", ""),
            ]
        )
    return table


HEADER = ["case", "ours ms", "reference ms", "reference", "speed-up", "x floor", "agreement"]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells) + " |" for cells in format_rows(rows)]
    return "\n".join(lines)


def plain(rows: list[dict]) -> str:
    table = [HEADER, *format_rows(rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--only", default="", help="run only modules whose name contains this")
    parser.add_argument("--markdown", default=None, help="also write the table as markdown to this file")
    args = parser.parse_args(argv)
    device = _device(args.device)
    rows: list[dict] = []
    failed = False
    for name in MODULES:
        if args.only and args.only not in name:
            continue
        print(f"running bench.{name} on {device} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"bench.{name}")
            rows += module.cases(device)
            if hasattr(module, "scaling"):
                rows += module.scaling(device)
        except Exception:  # noqa: BLE001 - report the failing module and go on with the others
            failed = True
            traceback.print_exc()
            rows.append({"case": f"{name}: FAILED (see stderr)", "ours_s": 0.0, "agreement": "failed"})
    print(machine_line(device))
    print(plain(rows))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{machine_line(device)}\n\n{markdown(rows)}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
