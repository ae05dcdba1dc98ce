"""What every benchmark shares: the formula workload, and naming the machine and commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from bench.server import ROOT


def formula_images(data: Path, count: int) -> list[bytes]:
    """A fixed list of real formula images, read once into memory."""
    folder = data / "im2latex-val" / "images"
    names = sorted(folder.glob("*.png"), key=lambda p: int(p.stem))[:count]
    if not names:
        raise SystemExit(f"no images under {folder}; pass --data")
    return [p.read_bytes() for p in names]


def machine() -> str:
    cores = os.cpu_count()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{cores} cores, {model}"


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
