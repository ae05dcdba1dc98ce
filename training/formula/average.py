"""Average the weights of several checkpoints of one formula model.

Checkpoints of one training lineage (each run continued from the one before) lie
close together; their mean often reads better than any one of them. The models must
share their config and tokenizer: averaging weights that mean different tokens or
shapes gives nonsense, so that is refused.

    python -m training.formula.average --out /tmp/avg run22/ run23/

The output directory is a complete model (config, tokenizer, preprocessing from the
first checkpoint, the averaged ``model.safetensors`` in the first one's dtypes).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
# Written by `save_pretrained` whatever the model: which transformers saved it, from where.
SAVE_NOISE = ("transformers_version", "_name_or_path")


def _config(model: Path) -> dict:
    """The model's config as transformers reads it (defaults filled in), without what
    only says where and by which version it was saved: a checkpoint saved by another
    transformers release writes its config differently and is still the same model."""
    from transformers import AutoConfig

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in SAVE_NOISE}
        return value

    return clean(AutoConfig.from_pretrained(model).to_dict())


def _same_files(models: list[Path]) -> None:
    checks = {
        "config.json": _config,
        "tokenizer.json": lambda model: json.loads((model / "tokenizer.json").read_text()),
    }
    for name, read in checks.items():
        first = read(models[0])
        for other in models[1:]:
            if read(other) != first:
                raise SystemExit(
                    f"{other / name} differs from {models[0] / name}: not one model's checkpoints"
                )


def average(models: list[Path], weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """The (weighted) mean of the models' tensors, each in the first model's dtype."""
    if weights is None:
        weights = [1.0] * len(models)
    if len(weights) != len(models) or sum(weights) <= 0:
        raise ValueError("one positive weight per model")
    total = sum(weights)
    states = [load_file(str(model / WEIGHTS)) for model in models]
    keys = states[0].keys()
    for model, state in zip(models[1:], states[1:], strict=True):
        if state.keys() != keys:
            raise SystemExit(f"{model} has other tensors than {models[0]}")
    mean = {}
    for key in keys:
        first = states[0][key]
        if not first.is_floating_point():
            mean[key] = first
            continue
        parts = zip(states, weights, strict=True)
        acc = sum(state[key].float() * (weight / total) for state, weight in parts)
        mean[key] = acc.to(first.dtype).contiguous()
    return mean


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help="model directories (at least two)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--weights", help="comma-separated weight per model (default: equal)")
    args = parser.parse_args(argv)
    if len(args.models) < 2:
        parser.error("average needs at least two models")
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    _same_files(args.models)
    mean = average(args.models, weights)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.models[0].iterdir():
        if path.is_file() and path.name != WEIGHTS:
            shutil.copy2(path, args.out / path.name)
    save_file(mean, str(args.out / WEIGHTS), metadata={"format": "pt"})
    print(f"{args.out / WEIGHTS}: mean of {', '.join(str(m) for m in args.models)}")


if __name__ == "__main__":
    main()
