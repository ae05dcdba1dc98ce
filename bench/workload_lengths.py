"""How long the benchmarks' formulas are: the spread that sets a continuous decoder's p99 / p50.

    python -m bench.workload_lengths --data ../shared/data --images 500

A formula's decode takes as many steps as its tokens, so under continuous batching its
latency follows its length, and the throughput its mean. Prints the token counts (the
tokens the model writes for the reference LaTeX, `model_tokens`, without the start and
end tokens) of the first `--images` im2latex-val images, the workload of `bench.compare`
and the device calls: their mean and the percentiles that matter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from bench.server import ROOT
from training.formula.data import read_formulas
from training.formula.tokenizer import model_tokens

PERCENTILES = (50, 90, 95, 99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--images", type=int, default=500)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    samples = sorted(
        read_formulas(args.data / "im2latex-val"), key=lambda s: int(Path(s.name).stem)
    )
    counts = np.array([len(model_tokens(tokenizer, s.formula)) for s in samples[: args.images]])
    at = {p: float(np.percentile(counts, p)) for p in PERCENTILES}
    print(f"{len(counts)} formulas, tokens without start and end\n")
    print("| mean | " + " | ".join(f"p{p}" for p in PERCENTILES) + " | p99 / p50 |")
    print("|" + "---:|" * (len(PERCENTILES) + 2))
    cells = " | ".join(f"{at[p]:.0f}" for p in PERCENTILES)
    print(f"| {counts.mean():.1f} | {cells} | {at[99] / at[50]:.2f} |")


if __name__ == "__main__":
    main()
