"""Train Texel's printed-formula recognizer and save it as a Hugging Face model directory.

    python -m training.formula.train --data ../shared/data/im2latex-val --out models/formula/default

The model is a `VisionEncoderDecoderModel`: an AIMv2 vision transformer in its
native-resolution mode (2-D sin-cos positions computed for each input size, so
any width works and right padding leaves the content's positions unchanged)
and a TrOCR decoder over a word-level im2latex vocabulary. Training mixes the
real images of the train split with formulas rendered on the fly by
`training.formula.synth` in a pool of worker processes and, with `--rendered`, a
set drawn beforehand by real LaTeX (`training.formula.latex_render`); with `--school`,
school-mathematics formulas (`training.formula.school`) are rendered beside them and
their tokens join the vocabulary (appended, so a continued model keeps its ids); every batch
is padded like a server batch. With `--small-share`, a share of the real and
rendered pictures is also shown smaller (`smaller_copies`), as a screenshot taken at a
lower resolution gives it. With `--merges`, the vocabulary gains merged tokens
(`learn_merges`: `_ {`, `^ { 2 }`, ...), so the model writes a formula in fewer steps;
a continued model's new rows start at the mean of their parts' rows. With `--cycles`, the
schedule restarts and each cycle's end is saved, checkpoints to average. At the end the
dev split is decoded greedily and scored, and the model is saved (fp16 safetensors,
tokenizer, preprocessor and generation configs).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import random
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm import tqdm

from models.formula.preprocess import FormulaImageSpec, decode_image, prepare_strip
from training.formula import synth
from training.formula.data import MAX_PIXELS, load_strips, read_formulas, split_samples
from training.formula.evaluate import markdown_table, recognize, score
from training.formula.latex_render import read_rendered
from training.formula.school import read_formulas as read_school_formulas
from training.formula.school import split_formulas as split_school
from training.formula.tokenizer import (
    build_tokenizer,
    build_vocabulary,
    encode_formula,
    learn_merges,
    read_vocab_file,
)

MAX_TOKENS = 200  # longest target kept for training (im2latex formulas reach ~150 tokens)


def default_spec() -> FormulaImageSpec:
    # Height 64 with at most 2x enlargement keeps im2latex glyphs at one size (about
    # 12 px x-height) instead of blowing flat formulas up to the full height.
    return FormulaImageSpec(height=64, max_width=1024, width_multiple=32, max_upscale=2.0)


def build_model(vocab_size: int, spec: FormulaImageSpec, args: argparse.Namespace):
    from transformers import (
        GenerationConfig,
        TrOCRConfig,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
    )
    from transformers.models.aimv2.configuration_aimv2 import Aimv2VisionConfig

    encoder = Aimv2VisionConfig(
        hidden_size=args.enc_dim,
        intermediate_size=args.enc_dim * 4,
        num_hidden_layers=args.enc_layers,
        num_attention_heads=args.enc_dim // 32,
        num_channels=spec.channels,
        image_size=spec.height,
        patch_size=8,
        is_native=True,
        use_head=False,
    )
    decoder = TrOCRConfig(
        vocab_size=vocab_size,
        d_model=args.dec_dim,
        decoder_layers=args.dec_layers,
        decoder_attention_heads=args.dec_dim // 32,
        decoder_ffn_dim=args.dec_dim * 4,
        max_position_embeddings=256,
        use_learned_position_embeddings=True,
        layernorm_embedding=True,
        dropout=0.1,
        is_decoder=True,
        add_cross_attention=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = 1
    config.pad_token_id = 0
    config.eos_token_id = 2
    config.bos_token_id = 1
    model = VisionEncoderDecoderModel(config=config)
    model.generation_config = GenerationConfig(
        max_new_tokens=MAX_TOKENS,
        decoder_start_token_id=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        num_beams=1,
        do_sample=False,
    )
    return model


def save_model(model, tokenizer, spec: FormulaImageSpec, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out_dir)
    model.float()
    tokenizer.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(spec.to_preprocessor_config(), indent=2) + "\n"
    )


class SyntheticStream:
    """Formula renders arriving from a process pool into a bounded in-memory pool."""

    def __init__(
        self,
        formulas: list[str],
        spec: FormulaImageSpec,
        tokenizer,
        seed: int,
        workers: int,
        capacity: int,
        school: list[str] = (),
    ):
        self.strips: list[np.ndarray] = []
        self.ids: list[list[int]] = []
        self.capacity = capacity
        self.rendered = 0
        self._next_slot = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tokenizer = tokenizer
        context = mp.get_context("fork")
        self._pool = context.Pool(
            workers,
            initializer=synth.init_worker,
            initargs=(formulas, spec, MAX_TOKENS, list(school)),
        )
        jobs = ((seed * 1_000_003 + i, 32) for i in range(10**9))
        self._results = self._pool.imap_unordered(synth.render_chunk, jobs, chunksize=1)
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        for chunk in self._results:
            if self._stop.is_set():
                return
            with self._lock:
                for strip, formula in chunk:
                    ids = encode_formula(self._tokenizer, formula, MAX_TOKENS)
                    if not ids:
                        continue
                    if len(self.strips) < self.capacity:
                        self.strips.append(strip)
                        self.ids.append(ids)
                    else:  # replace the oldest render
                        self.strips[self._next_slot] = strip
                        self.ids[self._next_slot] = ids
                        self._next_slot = (self._next_slot + 1) % self.capacity
                    self.rendered += 1

    def sample(self, rng: np.random.Generator, count: int) -> list[tuple[np.ndarray, list[int]]]:
        with self._lock:
            if not self.strips:
                return []
            picks = rng.integers(len(self.strips), size=count)
            return [(self.strips[i], self.ids[i]) for i in picks]

    def close(self) -> None:
        self._stop.set()
        self._pool.terminate()


def _rendered_strip(spec: FormulaImageSpec, gray: np.ndarray) -> np.ndarray:
    return prepare_strip(Image.fromarray(gray), spec)


def extended_vocabulary(saved: dict[str, int], tokens: set[str]) -> list[str]:
    """A saved model's vocabulary in id order, then the `tokens` it lacks, sorted."""
    ordered = sorted(saved, key=saved.__getitem__)
    assert [saved[t] for t in ordered] == list(range(len(ordered))), "saved ids have gaps"
    return [*ordered, *sorted(tokens - saved.keys())]


def school_tokens(formulas: Sequence[str], min_count: int = 2) -> set[str]:
    """Tokens used by at least `min_count` formulas: rarer ones (typos, glued
    commands such as `\\LambdaBEF`) stay out, and so do the formulas using them."""
    counts: dict[str, int] = {}
    for formula in formulas:
        for token in set(formula.split()):
            counts[token] = counts.get(token, 0) + 1
    return {token for token, count in counts.items() if count >= min_count}


def resize_vocabulary(model, size: int):
    """`model` with its decoder's (tied) token embeddings grown to `size` rows; new rows
    start at the mean of the trained ones, the transformers default."""
    if size != model.config.decoder.vocab_size:
        model.decoder.resize_token_embeddings(size)
        model.config.decoder.vocab_size = size
    return model


def init_merged_rows(model, vocabulary: Sequence[str], start: int):
    """`model` with each merged token at id `start` or later (`learn_merges`) embedded as
    the mean of its parts' rows (the output layer is tied to them): it starts reading and
    scoring a run of tokens about as it did the tokens one by one."""
    ids = {token: i for i, token in enumerate(vocabulary)}
    weight = model.decoder.get_input_embeddings().weight
    with torch.no_grad():
        for i in range(start, len(vocabulary)):
            parts = vocabulary[i].split(" ")
            if len(parts) > 1:
                weight[i] = weight[[ids[part] for part in parts]].mean(dim=0)
    return model


def load_rendered(
    paths: str, spec: FormulaImageSpec, tokenizer, workers: int
) -> tuple[list[tuple[np.ndarray, list[int]]], list[np.ndarray]]:
    """Pre-rendered LaTeX sets (comma-separated paths) as (strip, token ids), strips made
    like the real ones', and the pictures they were made from (the same order).

    Formulas with a token outside the vocabulary, or too long, are skipped and counted.
    """
    rows = [row for path in paths.split(",") for row in read_rendered(path)]
    kept, out_of_vocab, too_long = [], 0, 0
    for gray, formula in rows:
        ids = encode_formula(tokenizer, formula, MAX_TOKENS)
        if not ids:
            too_long += 1
        elif tokenizer.unk_token_id in ids:
            out_of_vocab += 1
        else:
            kept.append((gray, ids))
    with mp.get_context("fork").Pool(max(1, workers)) as pool:
        strips = pool.map(partial(_rendered_strip, spec), [gray for gray, _ in kept], chunksize=256)
    print(
        f"rendered sets {paths}: {len(kept)} of {len(rows)} images; skipped {out_of_vocab} "
        f"(tokens outside the vocabulary), {too_long} (over {MAX_TOKENS - 1} tokens)",
        flush=True,
    )
    pairs = [(strip, ids) for strip, (_, ids) in zip(strips, kept, strict=True)]
    return pairs, [gray for gray, _ in kept]


# How much smaller a low-resolution screenshot is than the trained scale, and how a
# screenshot tool or browser may have shrunk it.
SMALL_FACTORS = (0.4, 0.7)
SMALL_RESAMPLERS = (Image.Resampling.BOX, Image.Resampling.BILINEAR, Image.Resampling.LANCZOS)


def _smaller_strip(spec: FormulaImageSpec, job: tuple[int, np.ndarray]) -> np.ndarray:
    seed, gray = job
    rng = np.random.default_rng(seed)
    image = Image.fromarray(gray)
    factor = rng.uniform(*SMALL_FACTORS)
    size = (max(1, round(image.width * factor)), max(1, round(image.height * factor)))
    resample = SMALL_RESAMPLERS[int(rng.integers(len(SMALL_RESAMPLERS)))]
    return prepare_strip(image.resize(size, resample), spec)


def smaller_copies(
    items: Sequence[tuple[np.ndarray, list[int]]],
    grays: Sequence[np.ndarray],
    share: float,
    spec: FormulaImageSpec,
    rng: np.random.Generator,
    workers: int,
) -> list[tuple[np.ndarray, list[int]]]:
    """For a random `share` of `items` (strip, ids), a second strip made from its picture
    (`grays`, the same order) shrunk to `SMALL_FACTORS` of its size by one of
    `SMALL_RESAMPLERS`, then prepared as the server prepares an upload."""
    picks = rng.choice(len(items), size=round(share * len(items)), replace=False).tolist()
    jobs = [(int(rng.integers(2**31)), grays[i]) for i in picks]
    with mp.get_context("fork").Pool(max(1, workers)) as pool:
        strips = pool.map(partial(_smaller_strip, spec), jobs, chunksize=256)
    return [(strip, items[i][1]) for strip, i in zip(strips, picks, strict=True)]


def make_batch(
    items: Sequence[tuple[np.ndarray, list[int]]], spec: FormulaImageSpec, extra_pad: int
):
    """uint8 images padded white on the right to a multiple of 64 px, decoder inputs and labels."""
    width = max(s.shape[1] for s, _ in items) + extra_pad
    width = min(spec.max_width, max(64, math.ceil(width / 64) * 64))
    images = np.full((len(items), spec.height, width), 255, dtype=np.uint8)
    length = max(len(ids) for _, ids in items)
    labels = np.full((len(items), length), -100, dtype=np.int64)
    decoder_inputs = np.zeros((len(items), length), dtype=np.int64)
    for i, (strip, ids) in enumerate(items):
        w = min(width, strip.shape[1])
        images[i, :, :w] = strip[:, :w]
        labels[i, : len(ids)] = ids
        decoder_inputs[i, 0] = 1  # decoder start (BOS)
        decoder_inputs[i, 1 : len(ids)] = ids[:-1]
    return torch.from_numpy(images), torch.from_numpy(decoder_inputs), torch.from_numpy(labels)


def grow_decoder(model, layers: int):
    """`model` with its decoder deepened to `layers`: each new layer is a copy of the top
    layer with its attention and feed-forward outputs zeroed, so it adds only its layer
    norms (the top layer's) at first and training decides what it becomes."""
    import copy

    from transformers import VisionEncoderDecoderModel

    decoder = model.decoder.model.decoder
    added = layers - len(decoder.layers)
    if added <= 0:
        return model
    for _ in range(added):
        layer = copy.deepcopy(decoder.layers[-1])
        for projection in (layer.self_attn.out_proj, layer.encoder_attn.out_proj, layer.fc2):
            torch.nn.init.zeros_(projection.weight)
            torch.nn.init.zeros_(projection.bias)
        decoder.layers.append(layer)
    config = copy.deepcopy(model.config)
    config.decoder.decoder_layers = layers
    # A saved fp16 model's config says fp16, and the new model would be built in it.
    grown = VisionEncoderDecoderModel(config=config).to(next(model.parameters()).dtype)
    grown.load_state_dict(model.state_dict())
    grown.generation_config = model.generation_config
    return grown


def gpu_pixels(
    images: torch.Tensor, spec: FormulaImageSpec, generator: torch.Generator, augment: bool
) -> torch.Tensor:
    """Normalize like `pad_and_normalize`, with mild contrast and noise jitter when training."""
    x = images.float()
    if augment:
        n = x.shape[0]
        ink = torch.empty(n, 1, 1, device=x.device).uniform_(0.75, 1.05, generator=generator)
        x = 255.0 - (255.0 - x) * ink
        sigma = torch.empty(n, 1, 1, device=x.device).uniform_(0.0, 6.0, generator=generator)
        sigma = sigma * (torch.rand(n, 1, 1, device=x.device, generator=generator) < 0.3)
        x = x + sigma * torch.randn(x.shape, device=x.device, generator=generator)
        x = x.clamp(0, 255).round()
    x = (x / 255.0 - spec.mean) / spec.std
    return x[:, None].expand(-1, spec.channels, -1, -1)


def lr_at(step: int, progress: float, warmup: int, peak: float, cycles: int = 1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 2% as `progress` goes 0 -> 1.

    With `cycles` > 1 the decay runs that many times in a row, each restarting at `peak`
    (a warm restart, no second warm-up), so the run passes through `cycles` annealed points.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    within = 1.0 if progress >= 1.0 else (progress * cycles) % 1.0
    return peak * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * within)))


def evaluate_dev(model, tokenizer, spec, strips, references, device, batch_size=128):
    model.eval()
    with torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
    ):
        hypotheses = recognize(model, tokenizer, spec, strips, batch_size)
    model.train()
    return score(references, hypotheses), hypotheses


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/im2latex-val", help="im2latex-val folder")
    parser.add_argument(
        "--out", default="models/formula/default", help="where the model directory is written"
    )
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=0,
        help="training-loop time budget: the schedule ends at --steps or at this time, "
        "whichever comes first",
    )
    parser.add_argument("--batch-size", type=int, default=192)
    parser.add_argument("--lr", type=float, default=7e-4)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument(
        "--real-fraction", type=float, default=0.25, help="share of each batch from real images"
    )
    parser.add_argument(
        "--rendered",
        default="",
        help="pre-rendered LaTeX sets to mix in, comma-separated (folders, .lvl.xz or "
        ".tar.xz from latex_render)",
    )
    parser.add_argument(
        "--rendered-fraction",
        type=float,
        default=0.3,
        help="with --rendered: share of each batch from that set",
    )
    parser.add_argument(
        "--small-share",
        type=float,
        default=0.0,
        help="share of the real and rendered pictures also shown at 0.4-0.7 times their "
        "size, as a second copy (smaller_copies)",
    )
    parser.add_argument(
        "--school",
        default="",
        help="k12-formulas folder: render its train formulas too and add their tokens",
    )
    parser.add_argument(
        "--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="render processes"
    )
    parser.add_argument(
        "--merges",
        type=int,
        default=0,
        help="merged tokens to add to the vocabulary, learned from the train formulas "
        "(learn_merges); a formula then takes fewer decoding steps",
    )
    parser.add_argument("--pool-capacity", type=int, default=400_000)
    parser.add_argument("--enc-dim", type=int, default=256)
    parser.add_argument("--enc-layers", type=int, default=8)
    parser.add_argument("--dec-dim", type=int, default=256)
    parser.add_argument("--dec-layers", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument(
        "--cycles",
        type=int,
        default=1,
        help="run the cosine decay this many times in a row, each restarting at --lr; the "
        "end of every cycle but the last is saved beside --out as OUT-cycleN, checkpoints "
        "of one run to average (training.formula.average)",
    )
    parser.add_argument("--init-from", default="", help="continue training this saved model")
    parser.add_argument(
        "--grow-decoder-to",
        type=int,
        default=0,
        help="with --init-from: deepen its decoder to this many layers (grow_decoder)",
    )
    parser.add_argument(
        "--dev-limit", type=int, default=0, help="score only the first N dev images (0 = all)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="", help="JSON-lines log of losses and dev scores")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    rendered_fraction = args.rendered_fraction if args.rendered else 0.0
    if args.real_fraction + rendered_fraction > 1:
        parser.error("--real-fraction plus --rendered-fraction is over 1")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device(args.device)
    spec = default_spec()
    started = time.perf_counter()
    log_file = open(args.log, "a") if args.log else None  # noqa: SIM115 (closed at the end)

    def log(record: dict) -> None:
        record["elapsed_s"] = round(time.perf_counter() - started, 1)
        if log_file:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()

    samples = read_formulas(args.data)
    train, dev = split_samples(samples)
    if args.dev_limit:
        dev = dev[: args.dev_limit]
    vocab_file = Path(args.data) / "im2latex-vocab.txt"
    extra = read_vocab_file(vocab_file) if vocab_file.exists() else []
    school: list[str] = []
    if args.school:
        school, _ = split_school(read_school_formulas(args.school))
        extra = [*extra, *school_tokens(school)]
    vocabulary = build_vocabulary([s.formula for s in train], extra)
    if args.init_from:
        # Continue a saved model: its ids stay, and new tokens are appended after them.
        from transformers import AutoTokenizer

        saved = AutoTokenizer.from_pretrained(args.init_from).get_vocab()
        vocabulary = extended_vocabulary(saved, set(vocabulary))
    if args.merges:
        known = set(vocabulary)
        merges = learn_merges([s.formula for s in train], args.merges)
        vocabulary = [*vocabulary, *(m for m in merges if m not in known)]
    tokenizer = build_tokenizer(vocabulary)
    if school:
        known = set(vocabulary)
        school = [f for f in school if known.issuperset(f.split())]
    print(
        f"train {len(train)}, dev {len(dev)}, school {len(school)}, vocabulary {len(tokenizer)}",
        flush=True,
    )

    stream = SyntheticStream(
        [s.formula for s in train],
        spec,
        tokenizer,
        args.seed,
        args.workers,
        args.pool_capacity,
        school,
    )
    encoded = [encode_formula(tokenizer, s.formula, MAX_TOKENS) for s in train]
    steps = [len(ids) for ids in encoded if ids]
    print(f"decoding steps per train formula: {sum(steps) / len(steps):.1f}", flush=True)
    real = [
        (strip, ids)
        for strip, ids in zip(load_strips(args.data, train, spec), encoded, strict=True)
        if ids
    ]
    rendered, rendered_grays = [], []
    if args.rendered:
        rendered, rendered_grays = load_rendered(args.rendered, spec, tokenizer, args.workers)
    if args.small_share:
        images = Path(args.data) / "images"
        real_grays = [
            np.asarray(decode_image((images / s.name).read_bytes(), MAX_PIXELS).convert("L"))
            for s, ids in zip(train, encoded, strict=True)
            if ids
        ]
        real += smaller_copies(real, real_grays, args.small_share, spec, rng, args.workers)
        rendered += smaller_copies(
            rendered, rendered_grays, args.small_share, spec, rng, args.workers
        )
        print(f"smaller copies: {len(real) + len(rendered)} real and rendered strips", flush=True)
    dev_strips = load_strips(args.data, dev, spec)
    dev_refs = [s.formula for s in dev]
    print(f"real strips loaded in {time.perf_counter() - started:.0f} s", flush=True)

    if args.init_from:
        from transformers import VisionEncoderDecoderModel

        model = VisionEncoderDecoderModel.from_pretrained(args.init_from).float()
        model = grow_decoder(model, args.grow_decoder_to)
        trained_rows = model.config.decoder.vocab_size
        model = resize_vocabulary(model, len(tokenizer))
        model = init_merged_rows(model, vocabulary, trained_rows).to(device)
    else:
        model = build_model(len(tokenizer), spec, args).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        fused=device.type == "cuda",
    )
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed)
    log(
        {
            "event": "start",
            "args": vars(args),
            "parameters": params,
            "train": len(train),
            "dev": len(dev),
            "rendered": len(rendered),
        }
    )

    model.train()
    pending: list[list[tuple[np.ndarray, list[int]]]] = []
    group = 8  # batches drawn together and sorted by width, so padding stays small
    loss_avg = None
    step = 0
    progress = tqdm(total=args.steps, desc="train", mininterval=5)
    loop_started = time.perf_counter()

    def schedule_position() -> float:
        done = step / args.steps
        if args.max_minutes:
            done = max(done, (time.perf_counter() - loop_started) / (args.max_minutes * 60))
        return done

    cycles_saved = 0
    while (position := schedule_position()) < 1.0:
        if int(position * args.cycles) > cycles_saved:
            cycles_saved += 1
            snapshot = Path(f"{args.out}-cycle{cycles_saved}")
            save_model(copy.deepcopy(model), tokenizer, spec, snapshot)
            print(f"step {step}: cycle {cycles_saved} saved to {snapshot}", flush=True)
            log({"event": "cycle", "cycle": cycles_saved, "step": step})
        if not pending:
            total = group * args.batch_size
            n_rendered = int(total * rendered_fraction)
            synthetic = stream.sample(rng, total - int(total * args.real_fraction) - n_rendered)
            n_real = total - len(synthetic) - n_rendered
            items = [real[i] for i in rng.integers(len(real), size=n_real)] + synthetic
            if n_rendered:
                items += [rendered[i] for i in rng.integers(len(rendered), size=n_rendered)]
            items.sort(key=lambda item: item[0].shape[1])
            pending = [items[i : i + args.batch_size] for i in range(0, total, args.batch_size)]
            rng.shuffle(pending)
        batch = pending.pop()
        extra_pad = int(rng.integers(0, 257)) if rng.random() < 0.3 else 0
        images, decoder_inputs, labels = make_batch(batch, spec, extra_pad)
        images = images.to(device, non_blocking=True)
        decoder_inputs = decoder_inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        for group_ in optimizer.param_groups:
            group_["lr"] = lr_at(step, position, args.warmup, args.lr, args.cycles)
        with torch.autocast(
            device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
        ):
            pixels = gpu_pixels(images, spec, generator, augment=True)
            logits = model(pixel_values=pixels, decoder_input_ids=decoder_inputs).logits
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=0.1
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        progress.update(1)
        if step % 50 == 0 or step == 1:
            value = loss.item()
            loss_avg = value if loss_avg is None else 0.9 * loss_avg + 0.1 * value
            progress.set_postfix(loss=f"{loss_avg:.3f}", synth=stream.rendered)
            log(
                {
                    "step": step,
                    "loss": value,
                    "loss_avg": loss_avg,
                    "grad_norm": float(grad_norm),
                    "lr": optimizer.param_groups[0]["lr"],
                    "rendered": stream.rendered,
                    "width": images.shape[-1],
                }
            )
        if args.eval_every and step % args.eval_every == 0:
            quick, _ = evaluate_dev(
                model, tokenizer, spec, dev_strips[:256], dev_refs[:256], device
            )
            print(
                f"\nstep {step}: dev[:256] BLEU-4 {quick.bleu4:.4f}, "
                f"edit {quick.edit_distance:.4f}, "
                f"exact {quick.exact_match:.2%}",
                flush=True,
            )
            log({"step": step, "dev256": vars(quick)})
    progress.close()
    stream.close()
    train_minutes = (time.perf_counter() - started) / 60
    print(
        f"trained {step} steps in {train_minutes:.1f} min; {stream.rendered} formulas rendered",
        flush=True,
    )

    out_dir = Path(args.out)
    save_model(model, tokenizer, spec, out_dir)
    final, hypotheses = evaluate_dev(
        model.to(torch.float32), tokenizer, spec, dev_strips, dev_refs, device
    )
    table = markdown_table(final, {"steps": str(step), "train minutes": f"{train_minutes:.1f}"})
    print(table, flush=True)
    log({"event": "end", "steps": step, "dev": vars(final), "rendered": stream.rendered})
    if log_file:
        with open(Path(args.log).with_suffix(".dev_hyp.tsv"), "w") as f:
            for sample, hyp in zip(dev, hypotheses, strict=True):
                f.write(f"{sample.name}\t{hyp}\n")
        log_file.close()


if __name__ == "__main__":
    main()
