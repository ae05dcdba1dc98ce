"""`FormulaRecognizer`: a picture of a printed formula in, LaTeX out.

Any transformers `VisionEncoderDecoderModel` with its tokenizer and its image
processor's settings (`preprocessor_config.json`, or a processor's
`processor_config.json`), from a local directory or a hub id. The lifecycle is the same
as every Texel adapter: load, warm up, preprocess one request, bucket and cost, run a
batch on a device, postprocess one result.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
    VisionEncoderDecoderModel,
)
from transformers.utils import cached_file
from transformers.utils import logging as transformers_logging

from batching.errors import Cancelled
from models.base import DeviceRunner, Model, Stage
from models.devices import (
    model_name,
    out_of_memory_as_batching_error,
    resolve_dtype,
    side_stream,
)
from models.formula.fast_decode import StaticGreedyDecoder, token_ids
from models.formula.onnx_decode import LoneRowInt8Decoder, OnnxStaticDecoder
from models.formula.preprocess import (
    FormulaImageSpec,
    FormulaInput,
    FormulaPreprocessor,
    bucket_width,
    normalize_pixels,
    pad_strips,
    png_pixels,
)
from models.formula.style import canonical_latex, compact_latex
from telemetry import metrics

log = logging.getLogger(__name__)

# PNG uploads up to this many pixels (a formula screenshot at twice the scale, and more)
# and this many bytes are preprocessed on the HTTP process's event loop: about a
# millisecond of work, less than handing it to the thread pool and back costs
# (bench/RESULTS.md). Larger pictures, and other formats, whose size the upload does not
# tell without opening it, go to the pool, so that no picture holds the loop long. The
# bytes count too: Pillow reads every chunk of a file, so a few pixels followed by
# megabytes of chunks would hold the loop for seconds. A formula's PNG of that many
# pixels takes a few kilobytes, an anti-aliased screenshot up to about 15.
QUICK_PIXELS = 100_000
QUICK_BYTES = 32 * 1024

# Encoders whose position information copes with any input width.
VARIABLE_WIDTH_ENCODERS = frozenset({"swin", "donut-swin", "swinv2"})

# The longest output where neither the settings nor the model's generation config say.
DEFAULT_MAX_NEW_TOKENS = 256
# Decoders whose learned positions begin past the padding token's index (RoBERTa's).
PADDING_OFFSET_DECODERS = frozenset({"roberta", "xlm-roberta", "camembert"})

# Bucket width steps in input pixels. On a GPU every width group that joins a stream costs
# one encoder replay whatever its rows, so fewer, wider buckets pay
# (bench/device/formula_buckets.sh, bench/RESULTS.md); on a CPU padding is real compute.
GPU_BUCKET_STEP = 128
CPU_BUCKET_STEP = 64


def default_bucket_step(devices: list[torch.device]) -> int:
    """The bucket step for models served on `devices`."""
    gpu = any(torch.device(device).type == "cuda" for device in devices)
    return GPU_BUCKET_STEP if gpu else CPU_BUCKET_STEP


def accepts_any_width(encoder_config) -> bool:
    """Swin-style windows, or native-resolution ViTs (positions computed per input size)."""
    return encoder_config.model_type in VARIABLE_WIDTH_ENCODERS or bool(
        getattr(encoder_config, "is_native", False)
    )


def decoder_positions(decoder_config) -> int | None:
    """How many tokens the decoder can read, its start token included: the size of its
    learned position table (a greedy decode of N new tokens reads N); None where positions
    are computed for any length (TrOCR's sinusoids)."""
    if decoder_config.model_type == "trocr" and not decoder_config.use_learned_position_embeddings:
        return None
    size = getattr(decoder_config, "max_position_embeddings", None)
    if size is None:
        size = getattr(decoder_config, "n_positions", None)
    if size is None:
        return None
    if decoder_config.model_type in PADDING_OFFSET_DECODERS:
        size -= (decoder_config.pad_token_id or 0) + 1
    return int(size)


def default_max_new_tokens(generation: GenerationConfig | None, positions: int | None) -> int:
    """The longest output where the settings name none: the generation config's
    `max_new_tokens`, else `DEFAULT_MAX_NEW_TOKENS` or its `max_length` less the start
    token, whichever is less; never more than the decoder's positions."""
    limit = positions if positions is not None else math.inf
    named = getattr(generation, "max_new_tokens", None)
    if named:
        if named > limit:
            log.warning(
                "the generation config's max_new_tokens=%d exceeds the decoder's %d "
                "positions; answers stop at %d tokens",
                named,
                positions,
                positions,
            )
        return int(min(named, limit))
    longest = getattr(generation, "max_length", None)
    candidates = [DEFAULT_MAX_NEW_TOKENS, limit]
    if longest:
        candidates.append(max(1, longest - 1))
    return int(min(candidates))


@dataclass(frozen=True)
class FormulaTokens:
    """What a batch returns per request: generated token ids, before detokenization."""

    token_ids: list[int]
    decode_s: float  # the batch's decode time divided by its longest output
    confidence: float | None = None  # see `confidence()`; None where nothing was read


@dataclass(frozen=True)
class Recognized:
    """A recognized formula: spaced LaTeX, its token count and its compact form."""

    latex: str
    tokens: int
    compact: str = ""
    confidence: float | None = None


def confidence(logprob: float, generated: int) -> float | None:
    """How sure the model was of its answer: the geometric mean of the probabilities of
    the tokens it chose, its end token included (exp of their mean log-probability).

    Not a calibrated probability of being right; low values mark readings to check.
    None when the model's scores were not numbers (a half-precision checkpoint that
    overflows gives NaN): the answer still goes out, and JSON has no NaN."""
    value = math.exp(logprob / max(generated, 1))
    return value if math.isfinite(value) else None


class _StopWhen(StoppingCriteria):
    """Ends `generate()` early once every request in the batch has gone away."""

    def __init__(self, should_stop) -> None:
        self.should_stop = should_stop

    def __call__(self, input_ids, scores, **kwargs):
        stop = bool(self.should_stop())
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class FormulaRecognizer(Model):
    """Adapter for printed-formula recognition with a VisionEncoderDecoder model."""

    key = "formula"
    payload_type = FormulaInput
    output_type = FormulaTokens
    latency_sensitive = True
    quick_response = True  # detokenizing a formula and compacting it: tens of microseconds
    # Whether a stream queues the next run before harvesting the last (None: on CUDA,
    # where the device runs asynchronously; on a CPU it only delays the harvest).
    stream_ahead: bool | None = None

    def __init__(
        self,
        source: str,
        devices: list[torch.device],
        *,
        name: str | None = None,
        dtype: str = "auto",
        bucket_step: int | None = None,
        num_beams: int = 1,
        max_new_tokens: int | None = None,
        max_pixels: int = 16_000_000,
        decoder: str = "auto",
        continuous: bool = True,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__(source, model_name(source, name))
        self.devices = devices
        self.dtype_setting = dtype
        self.bucket_step = bucket_step or default_bucket_step(devices)
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.max_pixels = max_pixels
        self.decoder_setting = decoder
        self.continuous = continuous
        self.batch_invariant = batch_invariant
        self.spec: FormulaImageSpec | None = None
        self.tokenizer = None
        self._models: dict[str, VisionEncoderDecoderModel] = {}
        self._decoders: dict[str, StaticGreedyDecoder] = {}
        self._tokenizer_lock = threading.Lock()
        # Per CUDA device: pinned upload buffers, used in turn.
        self._uploads: dict[str, _PinnedBuffers] = {}

    # -- lifecycle -----------------------------------------------------------

    def open(self) -> None:
        """The tokenizer, the image spec and the token limit: what requests need."""
        transformers_logging.disable_progress_bar()  # a server's log is not a terminal
        self.tokenizer = AutoTokenizer.from_pretrained(self.source)
        config = AutoConfig.from_pretrained(self.source)
        fixed_size = not accepts_any_width(config.encoder)
        self.spec = FormulaImageSpec.from_pretrained(
            self._processor_folder(),
            channels=int(getattr(config.encoder, "num_channels", 1)),
            fixed_size=fixed_size,
            image_size=getattr(config.encoder, "image_size", None) if fixed_size else None,
        )
        positions = decoder_positions(config.decoder)
        if self.max_new_tokens is None:
            try:
                generation = GenerationConfig.from_pretrained(self.source)
            except OSError:  # no generation_config.json
                generation = None
            self.max_new_tokens = default_max_new_tokens(generation, positions)
        elif positions is not None and self.max_new_tokens > positions:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} (TEXEL_FORMULA__ADVANCED__MAX_NEW_TOKENS)"
                f" exceeds the decoder's {positions} positions; set it to {positions} or less"
            )

    def _processor_folder(self) -> Path:
        """The folder that holds the image processor's settings: the model's own, or for a
        hub id the cached snapshot (either file, as `image_processor_config` reads them)."""
        if Path(self.source).is_dir():
            return Path(self.source)
        found = [
            cached_file(self.source, name, _raise_exceptions_for_missing_entries=False)
            for name in ("processor_config.json", "preprocessor_config.json")
        ]
        for file in found:  # both fetched: the processor's may lack the image section
            if file is not None:
                return Path(file).parent
        raise FileNotFoundError(
            f"{self.source} has no preprocessor_config.json or processor_config.json"
        )

    def load(self, device: torch.device) -> None:
        """One model replica on `device`."""
        # bf16 on CPUs with bf16 matrix instructions too: the same dev scores as fp32,
        # the encoder twice as fast (training/formula/NOTES.md).
        dtype = resolve_dtype(self.dtype_setting, device, torch.bfloat16, torch.bfloat16)
        model = VisionEncoderDecoderModel.from_pretrained(self.source, dtype=dtype)
        self._models[str(device)] = model.to(device).eval()

    def warmup(self, device: torch.device, max_batch_size: int) -> None:
        """Run every bucket width once and the largest batch once on `device`.

        Call it on the thread that will run the device's batches: on a CPU, torch's
        OpenMP team belongs to the thread that first computes.
        """
        spec = self._spec
        widths = sorted(
            {bucket_width(w, spec, self.bucket_step) for w in range(1, spec.max_width + 1)}
        )
        blank = np.full((spec.height, spec.width_multiple), 255, dtype=np.uint8)
        key = str(device)
        if self._use_static_decoder(key):
            self._decoders[key] = self._static_decoder(key, widths, max_batch_size)
        decoder = self._decoders.get(key)
        if decoder is None or not decoder.encoded_every_shape:
            for width in widths:
                self._generate(key, [FormulaInput(blank, width)], lambda: False, max_new_tokens=2)
        batch = [FormulaInput(blank, widths[0])] * max_batch_size
        self._generate(key, batch, lambda: False, max_new_tokens=2)

    # -- per request ---------------------------------------------------------

    @functools.cached_property
    def preprocessor(self) -> FormulaPreprocessor:
        return FormulaPreprocessor(self._spec, self.bucket_step, self.max_pixels)

    def preprocess(self, data: bytes) -> FormulaInput:
        """Decode and normalize one upload."""
        return self.preprocessor(data)

    def quick_request(self, data: bytes) -> bool:
        if len(data) > QUICK_BYTES:
            return False
        pixels = png_pixels(data)
        return pixels is not None and pixels <= QUICK_PIXELS

    def request_stages(self) -> list[Stage]:
        return [("preprocess", self.preprocess)]

    def response_stages(self) -> list[Stage]:
        return [("tokenize", self.detokenize), ("postprocess", self.finish)]

    def span_attributes(self, stage: str, value: Any) -> dict[str, Any]:
        if stage == "preprocess":
            return {"texel.input.width": value.width, "texel.bucket": value.bucket}
        if stage == "tokenize":
            attributes = {"gen_ai.usage.output_tokens": value.tokens}
            if value.confidence is not None:
                attributes["texel.confidence"] = round(value.confidence, 4)
            return attributes
        return {}

    def bucket(self, item: FormulaInput) -> int:
        return item.bucket

    def cost(self, item: FormulaInput) -> float:
        """Encoder work grows with the padded width; decoding dominates and is per request."""
        return 1.0 + item.bucket / self._spec.max_width

    def padding_efficiency(self, batch: list[FormulaInput]) -> float | None:
        padded = sum(item.bucket for item in batch)
        return sum(min(item.width, item.bucket) for item in batch) / padded if padded else None

    def runner(self, device: torch.device) -> DeviceRunner:
        """Batches on `device`, and with the static decoder and `continuous` a stream
        (`batching.stream`) whose rows join and leave a running decode."""
        key = str(device)
        decoder = self._decoders.get(key)

        def run(batch: list[FormulaInput], should_stop) -> list[FormulaTokens]:
            return self._generate(key, batch, should_stop)

        stream = None
        if decoder is not None and self.continuous:
            stream = functools.partial(self._stream, decoder)
        return DeviceRunner(run, stream)

    @property
    def merge_buckets(self) -> bool:
        """Merge width buckets only where every device decodes rows independently of
        their padding (the static decoder); `generate()` would see the wider padding."""
        return bool(self._models) and all(key in self._decoders for key in self._models)

    def static_decoder(self, device: torch.device) -> StaticGreedyDecoder | None:
        """The static decoder serving `device`, if it uses one (benchmarks probe it)."""
        return self._decoders.get(str(device))

    def replica(self, device: torch.device) -> VisionEncoderDecoderModel:
        """The model loaded on `device`."""
        return self._models[str(device)]

    def uses_static_decoder(self, device: torch.device) -> bool:
        """Whether batches on `device` run Texel's static decoder (else `generate()`)."""
        return str(device) in self._decoders

    def detokenize(self, tokens: FormulaTokens) -> Recognized:
        """Token ids to LaTeX in Texel's style (`models.formula.style`; the `tokenize`
        stage)."""
        with self._tokenizer_lock:  # fast tokenizers are not safe to share across threads
            text = self.tokenizer.decode(tokens.token_ids, skip_special_tokens=True)
        metrics.OUTPUT_TOKENS.labels(self.name).observe(len(tokens.token_ids))
        if tokens.confidence is not None:
            metrics.CONFIDENCE.labels(self.name).observe(tokens.confidence)
        metrics.TIME_PER_OUTPUT_TOKEN.labels(self.name).observe(tokens.decode_s)
        return Recognized(canonical_latex(text), len(tokens.token_ids), "", tokens.confidence)

    def finish(self, recognized: Recognized) -> Recognized:
        """The compact form beside the spaced one (the `postprocess` stage)."""
        return Recognized(
            recognized.latex,
            recognized.tokens,
            compact_latex(recognized.latex),
            recognized.confidence,
        )

    # -- internals -----------------------------------------------------------

    def _use_static_decoder(self, device: str) -> bool:
        model = self._models[device]
        if self.decoder_setting == "generate":
            return False
        usable = self.num_beams == 1 and StaticGreedyDecoder.supports(model)
        if self.decoder_setting == "static":
            if not usable:
                raise ValueError(
                    "decoder=static needs greedy decoding (num_beams=1) and a TrOCR decoder"
                )
            return True
        return usable

    def _static_decoder(self, device: str, widths: list[int], max_batch_size: int):
        """A static-cache decoder sized for the widest bucket and the largest batch."""
        model = self._models[device]
        blank = np.full((self._spec.height, widths[-1]), 255, dtype=np.uint8)
        pixels = self._pixels([FormulaInput(blank, widths[-1])], device)
        with torch.inference_mode():
            source_len = model.encoder(pixel_values=pixels).last_hidden_state.shape[1]
        sizes = {
            "max_batch_size": max_batch_size,
            "max_new_tokens": self.max_new_tokens,
            "max_source_len": source_len,
        }
        decoder = None
        if OnnxStaticDecoder.supports(model):  # a float32 model on a CPU
            int8 = self.dtype_setting == "auto"  # float32 asked for: float32 throughout
            try:
                decoder = OnnxStaticDecoder(model, example=pixels, int8=int8, **sizes)
            except Exception as exc:  # an architecture the exporter does not take
                log.warning("decoding with PyTorch: ONNX export failed (%s)", exc)
        elif LoneRowInt8Decoder.supports(model) and self.dtype_setting == "auto":
            # bf16 for batches, the int8 graph for a row alone (`LoneRowInt8Decoder`).
            float_model = VisionEncoderDecoderModel.from_pretrained(
                self.source, dtype=torch.float32
            ).eval()
            decoder = LoneRowInt8Decoder(
                model, float_model=float_model, example=pixels.float(), **sizes
            )
        if decoder is None:
            decoder = StaticGreedyDecoder(
                model,
                batch_invariant=self.batch_invariant and model.device.type == "cuda",
                **sizes,
            )
        # Captures every batch size's CUDA graph, and the encoder's for every width.
        decoder.warmup([(pixels.shape[1], pixels.shape[2], width) for width in widths])
        return decoder

    @property
    def _spec(self) -> FormulaImageSpec:
        if self.spec is None:
            raise RuntimeError("FormulaRecognizer.load() has not run")
        return self.spec

    def _generate(
        self, device: str, batch: list[FormulaInput], should_stop, max_new_tokens: int | None = None
    ) -> list[FormulaTokens]:
        if any(item.blank for item in batch):  # no ink, no formula: answered empty, not read
            inked = [item for item in batch if not item.blank]
            read = iter(self._generate(device, inked, should_stop, max_new_tokens) if inked else [])
            return [FormulaTokens([], 0.0) if item.blank else next(read) for item in batch]
        decoder = self._decoders.get(device)
        started = time.perf_counter()
        with out_of_memory_as_batching_error(), torch.inference_mode():
            if decoder is not None and len(batch) <= decoder.max_batch_size:
                ids, sure = self._decode_static(decoder, batch, should_stop, max_new_tokens)
            else:
                ids, sure = self._decode_generate(device, batch, should_stop, max_new_tokens)
        elapsed = time.perf_counter() - started
        per_row = [self._content(row) for row in ids]
        longest = max((len(r) for r in per_row), default=1) or 1
        return [
            FormulaTokens(row, elapsed / longest, value)
            for row, value in zip(per_row, sure, strict=True)
        ]

    def _pixels(
        self, items: list[FormulaInput], device: str, staging: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Strips padded to their widest bucket, normalized, on the model's device.

        The bytes travel as uint8 (a quarter of float32) and are normalized on the
        device, in float32 as `pad_and_normalize` does, so the values are the same.
        With `staging` (pinned host memory, room for these strips) the copy is truly
        asynchronous: the worker goes on queueing work instead of waiting for the GPU.
        """
        model = self._models[device]
        width = max(item.bucket for item in items)
        strips = [i.strip for i in items]
        if staging is None:
            host = torch.from_numpy(pad_strips(strips, width))
        else:
            host = staging[: len(items) * self._spec.height * width]
            host = host.view(len(items), self._spec.height, width)
            pad_strips(strips, width, out=host.numpy())
        pixels = normalize_pixels(host.to(model.device, non_blocking=True), self._spec)
        return pixels.to(model.dtype)

    def _staging(self, decoder: StaticGreedyDecoder) -> _PinnedBuffers | None:
        """The device's pinned upload buffers (CUDA only), each with room for a full batch
        at the widest bucket."""
        if decoder.device.type != "cuda":
            return None
        key = str(decoder.device)
        size = decoder.max_batch_size * self._spec.height * self._spec.max_width
        if key not in self._uploads or self._uploads[key].size < size:
            # a decoder with more rows than the one the buffers were made for (benchmarks)
            self._uploads[key] = _PinnedBuffers(size, decoder.device)
        return self._uploads[key]

    def upload(
        self, decoder: StaticGreedyDecoder, batch: list[FormulaInput], *, aside: bool = False
    ) -> tuple[list[torch.Tensor], list[int], torch.cuda.Event | None]:
        """The batch's pixels on the device, one group per width bucket, the order of the
        batch's items in those groups, and with `aside` (CUDA) the event that marks them
        done on the upload stream they were made on (which waits for nothing queued)."""
        device = str(decoder.device)
        order = sorted(range(len(batch)), key=lambda i: batch[i].bucket)
        groups: dict[int, list[FormulaInput]] = {}
        for i in order:
            groups.setdefault(batch[i].bucket, []).append(batch[i])
        buffers = self._staging(decoder)
        if buffers is None:
            return [self._pixels(items, device) for items in groups.values()], order, None
        staging = buffers.acquire()
        pixels, used = [], 0
        current = torch.cuda.current_stream(decoder.device)
        with torch.cuda.stream(buffers.stream if aside else current):
            for items in groups.values():
                pixels.append(self._pixels(items, device, staging[used:]))
                used += pixels[-1][:, 0].numel()
            done = buffers.queued()
        return pixels, order, done if aside else None

    def _decode_static(
        self, decoder: StaticGreedyDecoder, batch, should_stop, max_new_tokens
    ) -> tuple[list[list[int]], list[float | None]]:
        """Each bucket of a merged batch encoded at its own width, decoded together: each
        item's tokens and confidence, in the batch's order."""
        pixels, order, _ = self.upload(decoder, batch)
        output = decoder.decode(pixels, max_new_tokens=max_new_tokens, should_stop=should_stop)
        ids: list[list[int]] = [[] for _ in batch]
        sure: list[float | None] = [None] * len(batch)
        for row, i in zip(output.rows, order, strict=True):
            ids[i], sure[i] = row.tokens, confidence(row.logprob, row.generated)
        return ids, sure

    def _stream(self, decoder: StaticGreedyDecoder, feed) -> None:
        """Continuous batching on `decoder`: at every check (`steps_per_check` steps) new
        requests join free rows, finished rows answer at once, rows whose clients went
        away are dropped.

        On CUDA the host stays one run ahead: it queues run N+1 before it harvests run
        N (waiting only for run N's snapshot), so the device decodes while Python
        answers, uploads and relays; a finished row keeps its slot one run longer.
        On a GPU shared with another model a run is twice as long, so the stream's looks
        cut into that model's work half as often.
        """
        rows: dict[int, tuple[int, float]] = {}  # slot -> (the feed's key, when it joined)
        checks = {
            shared: metrics.STREAM_CHECKS.labels(self.name, "shared" if shared else "alone")
            for shared in (False, True)
        }
        ahead = decoder.device.type == "cuda" if self.stream_ahead is None else self.stream_ahead
        pending = None  # the snapshot of the run before, not yet harvested
        try:
            with torch.inference_mode():
                while True:
                    new = feed.take(decoder.free_slots)
                    if new:
                        self.admit(decoder, new, rows, feed)
                    if not decoder.running and pending is None:
                        if feed.finish():
                            return
                        continue
                    with out_of_memory_as_batching_error():
                        latest = None
                        if decoder.running:
                            shared = feed.shares_device()
                            decoder.run(shared=shared)
                            checks[shared].inc()
                            latest = decoder.snapshot()
                        harvested, pending = (pending, latest) if ahead else (latest, None)
                        finished = decoder.harvest(harvested) if harvested is not None else {}
                    now = time.perf_counter()
                    answers: list[tuple[int, Any]] = []
                    for slot, row in finished.items():
                        key, joined = rows.pop(slot)
                        tokens = FormulaTokens(
                            self._content(row.tokens),
                            (now - joined) / max(row.generated, 1),
                            confidence(row.logprob, row.generated),
                        )
                        answers.append((key, tokens))
                    gone = set(feed.cancelled([key for key, _ in rows.values()]))
                    if gone:
                        slots = [slot for slot, (key, _) in rows.items() if key in gone]
                        decoder.release(slots)
                        for slot in slots:
                            answers.append((rows.pop(slot)[0], Cancelled("the client went away")))
                    if answers:
                        feed.done(answers)
        finally:  # a failed stream leaves no rows behind for the next one
            decoder.release(list(rows))

    def admit(self, decoder, new, rows: dict, feed) -> None:
        """Admit new requests into free rows; a request that cannot start fails alone.
        A request with no ink is answered empty at once."""
        if any(payload.blank for _, payload in new):
            feed.done([(key, FormulaTokens([], 0.0)) for key, payload in new if payload.blank])
            new = [(key, payload) for key, payload in new if not payload.blank]
            if not new:
                return
        batch = [payload for _, payload in new]
        try:
            with out_of_memory_as_batching_error():
                # Uploaded and encoded beside the steps already queued, not behind them.
                pixels, order, ready = self.upload(decoder, batch, aside=True)
                slots = decoder.admit(pixels, ready=ready)
        except Exception as exc:
            if len(new) == 1:
                feed.done([(new[0][0], exc)])
                return
            for one in new:  # find the one that fails; the others join
                self.admit(decoder, [one], rows, feed)
            return
        now = time.perf_counter()
        for slot, i in zip(slots, order, strict=True):
            rows[slot] = (new[i][0], now)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.all_special_ids)

    def _content(self, row: list[int]) -> list[int]:
        """A decoded row without its special tokens (start, end, padding)."""
        return [t for t in row if t not in self._special_ids]

    def _decode_generate(
        self, device: str, batch, should_stop, max_new_tokens
    ) -> tuple[list[list[int]], list[float | None]]:
        """`generate()`'s tokens for each item, and its confidence in them."""
        model = self._models[device]
        output = model.generate(
            pixel_values=self._pixels(batch, device),
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            num_beams=self.num_beams,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([_StopWhen(should_stop)]),
            output_scores=True,
            return_dict_in_generate=True,
        )
        ids = output.sequences.tolist()
        if self.num_beams > 1:  # each beam's mean token log-probability (length penalty 1)
            return ids, [confidence(v, 1) for v in output.sequences_scores.float().tolist()]
        scores = model.compute_transition_scores(
            output.sequences, output.scores, normalize_logits=True
        ).float()
        eos = set(token_ids(model.generation_config.eos_token_id))
        sure = []
        for row, logprobs in zip(ids, scores.tolist(), strict=True):
            generated = row[1:]
            count = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
            sure.append(confidence(sum(logprobs[:count]), count))
        return ids, sure


class _PinnedBuffers:
    """Pinned host buffers for uploads, used in turn: a buffer is written again only
    once the copies queued from it are done, so an upload does not wait for the work
    queued before it (the run the stream keeps ahead). Also the device's upload stream,
    for uploads that must not queue behind that work either."""

    def __init__(self, size: int, device: torch.device, count: int = 3) -> None:
        self.size = size
        self._buffers = [
            torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(count)
        ]
        self.stream = side_stream(device)
        self._copied: list[torch.cuda.Event | None] = [None] * count
        self._turn = 0

    def acquire(self) -> torch.Tensor:
        """The next buffer, once its last copies are done."""
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        return self._buffers[self._turn]

    def queued(self) -> torch.cuda.Event:
        """The copies from the acquired buffer are queued (on the current stream): mark
        their end, move on. Returns the mark."""
        copied = torch.cuda.Event()
        copied.record()
        self._copied[self._turn] = copied
        self._turn = (self._turn + 1) % len(self._buffers)
        return copied
