"""Pack the data a device run needs into git-ignored folders small enough to travel.

    python -m bench.device.pack_data --data ../shared/data

`.fd/fd.tar.xz`: every im2latex-val image reduced to 16 gray levels (4-bit PNG), with
formulas.tsv and the vocabulary, and the school formulas (`k12-formulas/formulas.txt`),
for training (about 9 MB instead of 57). `.gb/bench_images.tar`:
the first 500 images unchanged, the benchmarks' fixed workload (about 3 MB).
"""

from __future__ import annotations

import argparse
import lzma
import tarfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from training.formula.data import add_bytes, quantized_png

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--bench-images", type=int, default=500)
    args = parser.parse_args()
    source = args.data / "im2latex-val"
    images = sorted((source / "images").glob("*.png"), key=lambda p: int(p.stem))
    (ROOT / ".fd").mkdir(exist_ok=True)
    (ROOT / ".gb").mkdir(exist_ok=True)

    with ProcessPoolExecutor() as pool:
        pngs = list(pool.map(quantized_png, images, chunksize=64))
    with (
        lzma.open(ROOT / ".fd" / "fd.tar.xz", "wb", preset=6) as xz,
        tarfile.open(fileobj=xz, mode="w") as tar,
    ):
        for extra in ("formulas.tsv", "im2latex-vocab.txt"):
            tar.add(source / extra, f"im2latex-val/{extra}")
        for path, png in zip(images, pngs, strict=True):
            add_bytes(tar, f"im2latex-val/images/{path.name}", png)
        tar.add(args.data / "k12-formulas" / "formulas.txt", "k12-formulas/formulas.txt")
    with tarfile.open(ROOT / ".gb" / "bench_images.tar", "w") as tar:
        for path in images[: args.bench_images]:
            tar.add(path, f"im2latex-val/images/{path.name}")
    for packed in (ROOT / ".fd" / "fd.tar.xz", ROOT / ".gb" / "bench_images.tar"):
        print(f"{packed.relative_to(ROOT)}: {packed.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
