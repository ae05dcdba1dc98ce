"""What every benchmark shares: the formula workload, and naming the machine and commit."""

from __future__ import annotations

import functools
import json
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


@functools.cache
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


@functools.cache
def commit() -> str:
    """The commit under test: `TEXEL_COMMIT` where the tree travels without `.git`."""
    if sha := os.environ.get("TEXEL_COMMIT"):
        return sha
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        sha = ""
    return sha or "unknown"


def settings_env() -> dict[str, str]:
    """Texel and OpenTelemetry settings given in the environment beyond a command's own,
    for a record to name what it ran with."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(("TEXEL_", "OTEL_")) or k == "CUDA_VISIBLE_DEVICES"
    }


def append_records(records: list[dict], path: Path) -> None:
    """Append benchmark records to a JSON-lines results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
