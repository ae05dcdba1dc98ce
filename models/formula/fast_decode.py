"""Greedy decoding for the formula model with a static KV cache and CUDA graphs.

Why: transformers' `generate()` runs each decoding step as a few hundred small
kernel launches driven from Python, plus its own per-step bookkeeping (logits
processors, stopping criteria, a growing dynamic cache). For Texel's small TrOCR
decoder that launch overhead, the same whatever the batch size, is most of the
decode time (bench/RESULTS.md).

How: every tensor a step touches lives in buffers allocated once: the
self-attention K/V cache (`max_new_tokens + 2` positions), the cross-attention
K/V (`max_source_len` positions, each row's S positions valid and the rest
masked out by an additive source mask), the current tokens, each row's position
and token limit, the "finished" flags and the output. A step reads the
positions from a device tensor and advances them in place, so its kernels take
the same arguments every time; on CUDA one step per batch-size bucket is
captured as a CUDA graph and each later step is one `replay()`. Greedy argmax,
the EOS/limit bookkeeping and padding after a row's end happen inside the step,
so on CUDA Python only synchronizes every `CHECK_EVERY` steps (`SHARED_CHECK_EVERY` on a
GPU shared with another model) to see which rows are done (on a CPU, where looking
costs nothing, after every step). A graph holds
`steps_per_run` consecutive steps (on CUDA all `CHECK_EVERY`), so one `replay()` (one
Python call, one grab of the GIL that the event loop also wants) runs them all.
On a CPU the same step runs eagerly, one at a time; it still skips
`generate()`'s per-step overhead. With a bf16 model there, the KV cache and attention
stay fp32 and the step's weights are reordered once for oneDNN (`_Projection`), which
is where a CPU's bf16 time goes.

Rows are slots with positions of their own, so the batch need not start or end
together (continuous batching): `admit()` encodes new rows into free slots
between two runs of steps, `harvest()` hands back the rows that have finished
and frees their slots, and each row stops at its own token limit inside the
step. A row's tokens depend only on its own image, whatever the other slots
hold. `decode()` is one batch admitted at once and run to its end.

The host need not wait for the device between runs either. `snapshot()` queues a
copy of every row's state into pinned host memory behind the run; a stream
queues the next run first and only then `harvest(snapshot)`s the previous one,
so the device works through run N+1 while Python answers the rows that ended in
run N and uploads the next arrivals. Nothing on that path synchronizes: index
tensors travel through pinned memory, and a snapshot remembers which row each
slot held (`_epoch`), so a slot harvested, released or refilled since is not
reported twice.

The encoder gets the same treatment on CUDA. A served batch holds several width
buckets, each encoded alone, so eager encoding met a new (rows, width) shape on
almost every batch, and each new shape cost far more host time than the GPU work
(the worker thread spent most of its time inside the encoder's attention call
while the GPU idled; bench/HISTORY.md). Rows are padded up to a batch bucket,
so the shapes are few (batch buckets x widths), and `warmup(input_shapes)`
captures one encoder graph per shape before readiness: its replay writes the
cross-attention K/V of every decoder layer into its width's scratch buffer, from
which the group's rows are copied into place. An encoding of a few rows is bound by its
kernel launches, so where the model allows, the graph holds `FusedEncoder`'s (the same
arithmetic in fewer kernels; models/formula/fast_encode.py).

Admitting rows costs the device more than it looks: a join of a dozen rows spans
several width groups, each one encoder replay of about the same device time whatever
its rows, and on one stream they queued behind each other and behind the steps. So on
CUDA each input shape has a lane of its own (a CUDA stream, with its own graphs' memory
pool and buffers): the groups of one join encode side by side, and when the caller
uploaded the pixels on a stream of its own (`admit(..., ready=event)`) they do not wait
for the steps already queued either, and run while those steps do. That is safe
because a lane writes only free slots: a step computes free slots too but keeps nothing
it computes for them, and a slot's source mask is replaced in one copy, so a step
reading it half-written still sees position 0 open and stays finite. Only the row
state (`positions`, `tokens`, `finished`, ...), which every step writes, is reset on
the caller's stream, once the lanes are done.

The step reproduces `TrOCRDecoder` exactly (post-LN layers, query scaled by
head_dim**-0.5 before the dot product, learned or sinusoidal positions), reusing
the model's own modules and weights, so tokens match
`model.generate(num_beams=1, do_sample=False)`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from models.devices import GraphFamily, capture_graph, side_stream
from models.formula.fast_encode import FusedEncoder

logger = logging.getLogger(__name__)

# Steps between two host synchronizations (early-exit checks) on a GPU. On a GPU shared
# with another model a stream looks half as often (`run(shared=True)`): each look is a
# burst of high-priority work (the snapshot, the joins' encodings, the next run) that
# cuts into the other model's, and with looks every 4 steps the other model's share of
# the device suffered (bench/RESULTS.md).
CHECK_EVERY = 4
SHARED_CHECK_EVERY = 8
# Rows of every encoding with batch invariance (`StaticGreedyDecoder(batch_invariant=True)`).
ENCODER_ROWS = 8

# Generation settings that add logits processors, with their neutral values:
# with any other value greedy decoding is no longer a plain argmax.
_NEUTRAL_GENERATION_SETTINGS: dict[str, tuple] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "sequence_bias": (None,),
}


def _batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two below `max_batch_size`, plus `max_batch_size` itself."""
    buckets = {max_batch_size}
    size = 1
    while size < max_batch_size:
        buckets.add(size)
        size *= 2
    return sorted(buckets)


def token_ids(value: int | list[int] | None) -> list[int]:
    """A generation setting that names one token id, several or none, as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [int(value)]


class StaticGreedyDecoder:
    """Greedy decoding of a VisionEncoderDecoderModel with a TrOCR decoder, graph-ready."""

    # Whether `warmup` ran the encoder at every input shape it was given, as requests
    # will, so that its caller need not run them again.
    encoded_every_shape = False

    @staticmethod
    def supports(model) -> bool:
        """True for a VisionEncoderDecoderModel whose greedy decode this class reproduces."""
        from transformers import TrOCRForCausalLM, VisionEncoderDecoderModel

        if not isinstance(model, VisionEncoderDecoderModel):
            return False
        if not isinstance(model.decoder, TrOCRForCausalLM):
            return False
        config = model.decoder.config
        if not config.use_learned_position_embeddings and config.pad_token_id is None:
            return False
        generation = model.generation_config
        for name, neutral in _NEUTRAL_GENERATION_SETTINGS.items():
            if getattr(generation, name, None) not in neutral:
                return False
        start = generation.decoder_start_token_id
        if start is None:
            start = model.config.decoder_start_token_id
        return isinstance(start, int) and bool(token_ids(generation.eos_token_id))

    def __init__(
        self,
        model,
        *,
        max_batch_size: int,
        max_new_tokens: int,
        max_source_len: int,
        use_cuda_graphs: bool | None = None,
        steps_per_run: int | None = None,
        pad_encoder_rows: bool | None = None,
        batch_invariant: bool = False,
        fused_encoder: bool | None = None,
    ) -> None:
        if not self.supports(model):
            raise ValueError("StaticGreedyDecoder supports TrOCR-decoded models only")
        decoder = model.decoder.model.decoder
        config = decoder.config
        if config.use_learned_position_embeddings and max_new_tokens > (
            config.max_position_embeddings
        ):
            raise ValueError(
                f"max_new_tokens={max_new_tokens} exceeds the decoder's "
                f"{config.max_position_embeddings} positions"
            )
        self.model = model
        self.decoder = decoder
        self.lm_head: nn.Linear = model.decoder.output_projection
        self.max_batch_size = max_batch_size
        self.max_new_tokens = max_new_tokens
        self.max_source_len = max_source_len
        self.device = model.device
        self.dtype = model.dtype
        # The KV cache and attention: in fp32 on a CPU running a bf16 model, whose attention
        # kernels are several times slower in bf16 for a query of one (bench/RESULTS.md),
        # while its bf16 matrix multiplies pay. Elsewhere the model's dtype.
        self._cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.attention_dtype = torch.float32 if self._cpu_bf16 else self.dtype
        self.use_cuda_graphs = (
            self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        )
        # Steps per replay (or eager call); a divisor of CHECK_EVERY.
        self.steps_per_run = steps_per_run or (CHECK_EVERY if self.use_cuda_graphs else 1)
        if CHECK_EVERY % self.steps_per_run:
            raise ValueError(f"steps_per_run must divide {CHECK_EVERY}")
        # Steps between two looks at which rows are done (and two chances for new rows to
        # join). On CUDA a look waits for the device, so it comes every CHECK_EVERY steps;
        # on a CPU it waits for nothing, so it comes after every run: a finished row
        # stops costing steps and a new one joins without waiting out the others' steps.
        self.steps_per_check = CHECK_EVERY if self.device.type == "cuda" else self.steps_per_run
        # Encoder inputs padded to a batch bucket (few shapes, one graph each); on a
        # CPU there is no per-shape cost and padded rows would be real work.
        # Batch invariance: a row's answer must not depend on what else runs. On a GPU,
        # products of another row count run other kernels, which sum in another order,
        # and a near tie between two tokens can flip. So every step runs one shape, all
        # the slots, and every encoding one shape, ENCODER_ROWS rows (a larger group in
        # chunks). (A CPU's eager steps give a row the same answer in any batch as they
        # are; the adapter asks for this on GPUs only.)
        self.batch_invariant = batch_invariant
        self.pad_encoder_rows = batch_invariant or (
            self.device.type == "cuda" if pad_encoder_rows is None else pad_encoder_rows
        )
        if batch_invariant:
            self.step_buckets = [max_batch_size]
            self.encoder_buckets = [min(ENCODER_ROWS, max_batch_size)]
        else:
            self.step_buckets = self.encoder_buckets = _batch_buckets(max_batch_size)

        generation = model.generation_config
        start = generation.decoder_start_token_id
        self.start_id = int(start if start is not None else model.config.decoder_start_token_id)
        eos = token_ids(generation.eos_token_id)
        pad = generation.pad_token_id
        self.pad_id = int(eos[0] if pad is None else pad)

        first = decoder.layers[0].self_attn
        self.num_heads = first.num_heads
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        # Each layer's self-attention Q, K and V projections as one matrix: one matrix
        # multiply per step instead of three (fewer kernels to launch, or to replay).
        # A bf16 model on a CPU multiplies with weights reordered once into oneDNN's
        # blocked layout (`_Projection`).
        self.linears = [_StepLinears.of(layer, self._cpu_bf16) for layer in decoder.layers]
        # On CUDA the encoder runs in fewer kernels where it can (`FusedEncoder`): a join's
        # small encodings are bound by their launches. On a CPU there is no launch to
        # save (and ONNX Runtime fuses the model's own encoder as well; bench/RESULTS.md).
        if fused_encoder is None:
            fused_encoder = self.device.type == "cuda"
        self._fused_encoder = None
        if fused_encoder and FusedEncoder.supports(model):
            try:
                fused = FusedEncoder(model, decoder.layers, self.num_heads)
                agrees = fused.agrees(model, self._model_encode)
            except Exception as exc:  # a transformers version without what it reads
                logger.warning(
                    "encoding with the model's own encoder: the fused one failed (%s)", exc
                )
            else:
                if agrees:
                    self._fused_encoder = fused
                else:
                    logger.warning("encoding with the model's own encoder: the fused one differs")
        self.lm_projection = _Projection(self.lm_head.weight, self.lm_head.bias, self._cpu_bf16)
        self._allocate(len(decoder.layers), eos)
        self._graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self._family: GraphFamily | None = None  # the step graphs'
        self._warned_capture = False
        self._encoder_graphs: dict[tuple[int, ...], _EncoderGraph | None] = {}
        self._lanes: dict[tuple[int, ...], _Lane] = {}  # per encoder input shape (CUDA)
        # Width groups encoded on their shape's lane, side by side (see the module's notes).
        self.concurrent_admission = self.device.type == "cuda"

    def _allocate(self, num_layers: int, eos: list[int]) -> None:
        """The static buffers every step reads and writes."""
        device, dtype = self.device, self.attention_dtype
        batch, heads, dim = self.max_batch_size, self.num_heads, self.head_dim
        # Positions 0..max_new_tokens are written; a finished row rests one past its end.
        cache_len = self.max_new_tokens + 2
        self.self_k = torch.zeros(
            num_layers, batch, heads, cache_len, dim, device=device, dtype=dtype
        )
        self.self_v = torch.zeros_like(self.self_k)
        cross_shape = (num_layers, batch, heads, self.max_source_len, dim)
        self.cross_k = torch.zeros(cross_shape, device=device, dtype=dtype)
        self.cross_v = torch.zeros_like(self.cross_k)
        self.neg = torch.finfo(dtype).min
        # Per row: a row attends to its own source length only. An empty slot attends
        # to one (zero) position, so it computes finite values and no NaNs.
        self.source_mask = torch.full(
            (batch, 1, 1, self.max_source_len), self.neg, device=device, dtype=dtype
        )
        self.source_mask[..., :1] = 0
        self.cache_positions = torch.arange(cache_len, device=device)  # [T]
        self.eos_ids = torch.tensor(eos, device=device, dtype=torch.long)
        positions = self.decoder.embed_positions
        # Sinusoidal tables are a plain CPU attribute; HF moves the rows it picks to the device.
        self.sinusoids = getattr(positions, "weights", torch.empty(0)).to(device)
        # Per row: the position of the token it feeds next, and its token limit.
        self.positions = torch.zeros(batch, device=device, dtype=torch.long)
        self.limits = torch.full((batch,), self.max_new_tokens, device=device, dtype=torch.long)
        self.tokens = torch.full((batch,), self.start_id, device=device, dtype=torch.long)
        self.finished = torch.ones(batch, device=device, dtype=torch.bool)
        self.finished_at = torch.zeros(batch, device=device, dtype=torch.long)
        self.output = torch.full((batch, cache_len), self.pad_id, device=device, dtype=torch.long)
        # Per row: the summed log-probability of the tokens it chose (its confidence).
        self.logprob = torch.zeros(batch, device=device, dtype=torch.float32)
        # Host side: occupied slots, each one's source length, and an upper bound of
        # each one's position (eager attention reads only that far).
        self._live: set[int] = set()
        self._slot_source = [0] * batch
        self._slot_steps = [0] * batch
        # Bumped when a slot takes a new row: a snapshot names the rows it saw by it.
        self._epoch = [0] * batch
        # Snapshots: [finished, finished_at, *output] per slot, gathered on the device
        # and copied into host buffers used in turn (pinned on CUDA, so the copy is
        # asynchronous), at most `len(self._host_states) - 1` awaiting harvest.
        self._device_state = torch.empty((batch, cache_len + 2), device=device, dtype=torch.long)
        pinned = device.type == "cuda"
        self._host_states = [
            torch.empty((batch, cache_len + 2), dtype=torch.long, pin_memory=pinned)
            for _ in range(3)
        ]
        self._host_logprobs = [
            torch.empty(batch, dtype=torch.float32, pin_memory=pinned) for _ in range(3)
        ]
        self._host_turn = 0

    # -- public --------------------------------------------------------------

    @torch.inference_mode()
    def warmup(self, input_shapes: list[tuple[int, int, int]] | tuple = ()) -> None:
        """Capture every batch bucket's step graph (CUDA); on a CPU, one tiny eager step.

        `input_shapes` are the encoder inputs (channels, height, width) to expect, one
        per width bucket: with CUDA graphs, each gets one encoder graph per batch bucket.
        """
        if not self.use_cuda_graphs:
            self._step(1)
            return
        for bucket in sorted(self.step_buckets, reverse=True):
            self._runner(bucket)
        shapes = sorted(set(input_shapes), key=lambda shape: -math.prod(shape))
        for shape in shapes:
            for rows in sorted(self.encoder_buckets, reverse=True):
                key = (rows, *shape)
                if key not in self._encoder_graphs:
                    self._encoder_graphs[key] = self._capture_encoder(key)

    @torch.inference_mode()
    def decode(
        self,
        pixel_values: torch.Tensor | list[torch.Tensor],
        *,
        max_new_tokens: int | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Decoded:
        """Greedy tokens [batch, T] on the CPU, start token first, as `generate()` returns
        them, and each row as it finished (its own tokens and their log-probability).

        `pixel_values` is one batch, or a list of consecutive row groups each padded to
        its own width: each group is encoded alone and its rows attend only to their own
        source positions, so a row decodes as it would in a batch of its own width.
        Needs every slot free (no rows admitted and not yet harvested).
        """
        if self._live:
            raise RuntimeError("decode() needs every slot free")
        slots = self.admit(pixel_values, max_new_tokens=max_new_tokens)
        try:
            index = self._index(slots)
            limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
            steps = 0
            while steps < limit:
                self.run()
                steps += self.steps_per_check
                if bool(self.finished[index].all()) or should_stop():
                    break
            rows = self._rows(slots, stopped_after=min(steps, limit))
        finally:  # an error (out of memory) leaves every slot free for the next batch
            self.release(slots)
        width = max(len(row.tokens) for row in rows)
        out = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row.tokens)] = torch.tensor(row.tokens)
        return Decoded(out, rows)

    @torch.inference_mode()
    def admit(
        self,
        pixel_values: torch.Tensor | list[torch.Tensor],
        *,
        max_new_tokens: int | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> list[int]:
        """Encode new rows into the lowest free slots and start them; their slots, in order.

        `pixel_values` as for `decode()`. Rows already running go on unchanged.
        `ready` (CUDA): the pixels were made on another stream, which recorded this event
        after them; with `concurrent_admission` their encoding then waits for it alone,
        not for the steps queued on the current stream, and runs while those do. The
        rows start once both are done.
        """
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if limit > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={limit} exceeds {self.max_new_tokens}")
        groups = pixel_values if isinstance(pixel_values, list) else [pixel_values]
        count = sum(group.shape[0] for group in groups)
        free = [slot for slot in range(self.max_batch_size) if slot not in self._live]
        if count > len(free):
            raise ValueError(
                f"batch of {count} exceeds max_batch_size={self.max_batch_size}"
                + (f" with {len(self._live)} rows running" if self._live else "")
            )
        slots = free[:count]
        starts = np.cumsum([0] + [group.shape[0] for group in groups]).tolist()
        parts = [slots[a:b] for a, b in itertools.pairwise(starts)]
        if self.concurrent_admission and self.device.type == "cuda":
            self._load_sources_side_by_side(groups, parts, ready)
        else:
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            for group, group_slots in zip(groups, parts, strict=True):
                self._load_source(group.to(self.device, self.dtype), group_slots)
        # index_fill_, not `t[index] = scalar`: on CUDA that copies the scalar from the
        # host and waits for every queued run first.
        index = self._index(slots)
        self.positions.index_fill_(0, index, 0)
        self.limits.index_fill_(0, index, limit)
        self.tokens.index_fill_(0, index, self.start_id)
        self.finished.index_fill_(0, index, False)
        self.output.index_fill_(0, index, self.pad_id)
        self.output[:, 0].index_fill_(0, index, self.start_id)
        self.logprob.index_fill_(0, index, 0.0)
        for slot in slots:
            self._slot_steps[slot] = 0
            self._epoch[slot] += 1
        self._live.update(slots)
        return slots

    def run(self, shared: bool = False) -> None:
        """`steps_per_check` steps of every occupied slot (and the free ones below the
        highest, which idle); `shared` (another model is on the same GPU, which the
        engine says only of a GPU): `SHARED_CHECK_EVERY` steps."""
        if not self._live:
            return
        steps = SHARED_CHECK_EVERY if shared else self.steps_per_check
        # Eagerly, no padding rows (but with batch invariance); a graph per bucket otherwise.
        rows = max(self._live) + 1
        padded = self.use_cuda_graphs or self.batch_invariant
        bucket = self._bucket_of(rows) if padded else rows
        run = self._runner(bucket)  # captures first if warmup() did not
        for _ in range(steps // self.steps_per_run):
            run()

    @torch.inference_mode()
    def snapshot(self) -> Snapshot:
        """Queue a copy of every running row's state, as of the work queued so far.

        On CUDA the copy is asynchronous (pinned memory and an event); `harvest()` waits
        for it. At most two snapshots may await harvest at a time.
        """
        rows = max(self._live, default=-1) + 1
        host = self._host_states[self._host_turn]
        logprobs = self._host_logprobs[self._host_turn]
        self._host_turn = (self._host_turn + 1) % len(self._host_states)
        ready = None
        if rows:
            state = self._device_state[:rows]
            columns = [self.finished[:rows, None].long(), self.finished_at[:rows, None]]
            torch.cat([*columns, self.output[:rows]], dim=1, out=state)
            host[:rows].copy_(state, non_blocking=host.is_pinned())
            logprobs[:rows].copy_(self.logprob[:rows], non_blocking=host.is_pinned())
            if host.is_pinned():
                ready = torch.cuda.Event()
                ready.record()
        live = {slot: self._epoch[slot] for slot in self._live}
        return Snapshot(host[:rows], logprobs[:rows], ready, live)

    @torch.inference_mode()
    def harvest(self, snapshot: Snapshot | None = None) -> dict[int, Finished]:
        """The rows that had finished by `snapshot` (default: now), {slot: its tokens,
        start token first, and their summed log-probability}; frees their slots.

        A row harvested or released since the snapshot, or a slot refilled since, is
        not reported. Waits for the snapshot's copy, not for later work.
        """
        if snapshot is None:
            snapshot = self.snapshot()
        state = snapshot.host().numpy()
        logprobs = snapshot.logprobs.tolist()
        done = {}
        for slot in np.flatnonzero(state[:, 0]).tolist():
            epoch = snapshot.rows.get(slot)
            if epoch is not None and epoch == self._epoch[slot] and slot in self._live:
                end = int(state[slot, 1])
                tokens = state[slot, 2 : end + 4].tolist()
                done[slot] = Finished(tokens, logprobs[slot])
        self._live.difference_update(done)
        return done

    def release(self, slots: list[int]) -> None:
        """Free slots whose rows are no longer wanted (their clients went away)."""
        slots = [slot for slot in slots if slot in self._live]
        if slots:
            self.finished.index_fill_(0, self._index(slots), True)
            self._live.difference_update(slots)

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self._live)

    @property
    def running(self) -> int:
        """Rows admitted and not yet harvested or released."""
        return len(self._live)

    # -- per batch -----------------------------------------------------------

    def _bucket_of(self, rows: int, buckets: list[int] | None = None) -> int:
        """The smallest step bucket (or of `buckets`) holding `rows` rows."""
        return next(b for b in buckets or self.step_buckets if b >= rows)

    def _index(self, slots: list[int]) -> torch.Tensor:
        """`slots` as an index tensor on the device, without waiting for queued work (a
        plain `torch.tensor(..., device=cuda)` copy synchronizes)."""
        index = torch.tensor(slots, dtype=torch.long)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _rows(self, slots: list[int], stopped_after: int) -> list[Finished]:
        """Each slot's tokens so far: through its EOS (or limit), or `stopped_after` steps;
        and their summed log-probability."""
        snapshot = self.snapshot()
        state, logprobs = snapshot.host().tolist(), snapshot.logprobs.tolist()
        rows = []
        for slot in slots:
            finished, end, *tokens = state[slot]
            rows.append(
                Finished(
                    tokens[: end + 2] if finished else tokens[: stopped_after + 1],
                    logprobs[slot],
                )
            )
        return rows

    def _load_sources_side_by_side(
        self, groups: list[torch.Tensor], parts: list[list[int]], ready: torch.cuda.Event | None
    ) -> None:
        """Each width group encoded into its slots on its shape's lane; the current stream
        then waits for every lane used. Without `ready` the lanes first wait for the
        current stream (the pixels were made there)."""
        current = torch.cuda.current_stream(self.device)
        for group, group_slots in zip(groups, parts, strict=True):
            lane = self._lane(tuple(group.shape[1:]))
            if ready is None:
                lane.stream.wait_stream(current)
            else:
                lane.stream.wait_event(ready)
            with torch.cuda.stream(lane.stream):
                self._load_source(group.to(self.device, self.dtype), group_slots)
            if group.is_cuda:  # made on another stream: not reused before the lane reads it
                group.record_stream(lane.stream)
            current.wait_stream(lane.stream)

    def _lane(self, shape: tuple[int, ...]) -> _Lane:
        if shape not in self._lanes:
            self._lanes[shape] = _Lane(
                side_stream(self.device),
                GraphFamily.on(self.device),
                torch.zeros((self.max_batch_size, *shape), device=self.device, dtype=self.dtype),
            )
        return self._lanes[shape]

    def encoder_rows(self, count: int) -> int:
        """The rows an encoding of `count` rows (at most the largest encoder bucket) runs:
        padded up to a bucket where encodings are graphs of few shapes."""
        return self._bucket_of(count, self.encoder_buckets) if self.pad_encoder_rows else count

    def _load_source(self, pixel_values: torch.Tensor, slots: list[int]) -> None:
        """Encode rows into `slots`: their cross-attention K/V and source mask."""
        count = pixel_values.shape[0]
        if count > self.encoder_buckets[-1]:  # batch invariance: in chunks of one shape
            chunk = self.encoder_buckets[-1]
            for start in range(0, count, chunk):
                self._load_source(pixel_values[start : start + chunk], slots[start : start + chunk])
            return
        padded = self.encoder_rows(count)
        graph = self._encoder_graphs.get((padded, *pixel_values.shape[1:]))
        if graph is not None:
            kv = graph.run(pixel_values)
        else:
            if padded > count:  # zero rows: each row is encoded independently of the others
                filler = pixel_values.new_zeros((padded - count, *pixel_values.shape[1:]))
                pixel_values = torch.cat([pixel_values, filler])
            kv = self._encode(pixel_values)
        self._store_source(kv[:, :, :count], slots)

    def _store_source(
        self, kv: torch.Tensor, slots: list[int], mask: torch.Tensor | None = None
    ) -> None:
        """Put rows' cross-attention K/V [2, layers, rows, heads, S, D] into `slots`; each
        row attends to all S source positions, or where its additive `mask` [rows, S] is 0."""
        source_len = kv.shape[-2]
        if source_len > self.max_source_len:
            raise ValueError(f"source length {source_len} exceeds {self.max_source_len}")
        rows = self._index(slots)
        kv = kv.to(self.attention_dtype)
        self.cross_k[..., :source_len, :].index_copy_(1, rows, kv[0])
        self.cross_v[..., :source_len, :].index_copy_(1, rows, kv[1])
        # Built aside and copied in at once: a step reading a free slot's mask meanwhile
        # (concurrent admission) sees its old row or the new one, never one all closed.
        masks = torch.full(
            (len(slots), self.max_source_len),
            self.neg,
            device=self.device,
            dtype=self.attention_dtype,
        )
        masks[:, :source_len] = 0 if mask is None else mask
        self.source_mask[:, 0, 0].index_copy_(0, rows, masks)
        for slot in slots:
            self._slot_source[slot] = source_len

    def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Cross-attention K and V of every decoder layer: [2, layers, rows, heads, S, D]."""
        if self._fused_encoder is not None:
            return self._fused_encoder(pixel_values)
        return self._model_encode(pixel_values)

    def _model_encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`_encode` by the model's own encoder and K/V projections."""
        return self._cross_kv(self.model.encoder(pixel_values=pixel_values).last_hidden_state)

    def _cross_kv(self, hidden: torch.Tensor) -> torch.Tensor:
        """The encoder's output [rows, S, E] as every decoder layer's cross-attention K and V."""
        projection = getattr(self.model, "enc_to_dec_proj", None)
        if projection is not None:
            hidden = projection(hidden)
        keys = [self._heads(layer.encoder_attn.k_proj(hidden)) for layer in self.decoder.layers]
        values = [self._heads(layer.encoder_attn.v_proj(hidden)) for layer in self.decoder.layers]
        return torch.stack([torch.stack(keys), torch.stack(values)])

    # -- one step ------------------------------------------------------------

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, E] -> [B, H, L, D]."""
        return x.view(x.shape[0], -1, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, L, D] -> [B, L, E]."""
        return x.transpose(1, 2).reshape(x.shape[0], -1, self.num_heads * self.head_dim)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings (scaled) plus positions, then the optional embedding LayerNorm."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(tokens[:, None])
        table = decoder.embed_positions
        if decoder.config.use_learned_position_embeddings:
            # A finished row rests one past its last position; keep it inside the table.
            index = (positions + table.offset).clamp_(max=table.weight.shape[0] - 1)
            hidden = hidden + table.weight[index][:, None]
        else:
            padding = table.padding_idx
            index = torch.where(tokens != padding, positions + padding + 1, padding)
            index = index.clamp_(max=self.sinusoids.shape[0] - 1)
            hidden = hidden + self.sinusoids[index][:, None]
        if decoder.layernorm_embedding is not None:
            hidden = decoder.layernorm_embedding(hidden)
        return hidden

    def _layer(
        self,
        i: int,
        layer: nn.Module,
        hidden: torch.Tensor,
        rows: int,
        self_mask: torch.Tensor,
        write: torch.Tensor,
        source_len: int,
    ) -> torch.Tensor:
        """One post-LN TrOCR decoder layer for each row's new position: K/V written at
        `write` (each row's position), attention over the cache positions `self_mask`
        leaves open and the first `source_len` source positions."""
        cache_len = self_mask.shape[-1]
        linear = self.linears[i]
        adt, dtype = self.attention_dtype, self.dtype  # `.to()` is a no-op where they agree
        q, k, v = linear.qkv(hidden).to(adt).chunk(3, dim=-1)
        self.self_k[i, :rows].scatter_(2, write, self._heads(k))
        self.self_v[i, :rows].scatter_(2, write, self._heads(v))
        out = F.scaled_dot_product_attention(
            self._heads(q * self.scaling),
            self.self_k[i, :rows, :, :cache_len],
            self.self_v[i, :rows, :, :cache_len],
            attn_mask=self_mask,
            scale=1.0,
        )
        hidden = layer.self_attn_layer_norm(hidden + linear.self_out(self._merge(out).to(dtype)))

        out = F.scaled_dot_product_attention(
            self._heads(linear.cross_q(hidden).to(adt) * self.scaling),
            self.cross_k[i, :rows, :, :source_len],
            self.cross_v[i, :rows, :, :source_len],
            attn_mask=self.source_mask[:rows, ..., :source_len],
            scale=1.0,
        )
        hidden = layer.encoder_attn_layer_norm(
            hidden + linear.cross_out(self._merge(out).to(dtype))
        )

        feed_forward = linear.fc2(layer.activation_fn(linear.fc1(hidden)))
        return layer.final_layer_norm(hidden + feed_forward)

    def _logits(
        self,
        rows: int,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        self_mask: torch.Tensor,
        source_len: int,
    ) -> torch.Tensor:
        """The next token's logits [rows, vocabulary] of each row, its K/V written into the
        cache at its position; `self_mask` [rows, 1, 1, cache length] leaves open the
        positions up to each row's own."""
        hidden = self._embed(tokens, positions)
        write = positions[:, None, None, None].expand(rows, self.num_heads, 1, self.head_dim)
        for i, layer in enumerate(self.decoder.layers):
            hidden = self._layer(i, layer, hidden, rows, self_mask, write, source_len)
        return self.lm_projection(hidden[:, 0])

    def _step(self, rows: int) -> None:
        """Feed each row's current token, pick its next one greedily, advance its position.

        Finished rows (and free slots) compute too, but write only padding past their end
        and keep their position.
        """
        tokens, positions = self.tokens[:rows], self.positions[:rows]
        finished = self.finished[:rows]
        if self.use_cuda_graphs:
            # Graph-ready: whole buffers, every row's later positions masked out.
            cache_len, source_len = self.cache_positions.shape[0], self.max_source_len
        else:
            # Eager: Python knows how far any row can be, and the longest source, so
            # attention reads only that much of the buffers.
            live = [slot for slot in self._live if slot < rows] or [0]
            cache_len = min(
                max(self._slot_steps[slot] for slot in live) + 1, self.cache_positions.shape[0]
            )
            source_len = max(self._slot_source[slot] for slot in live) or 1
        self_mask = torch.zeros(
            (rows, 1, 1, cache_len), device=self.device, dtype=self.attention_dtype
        )
        self_mask.masked_fill_(
            self.cache_positions[:cache_len] > positions[:, None, None, None], self.neg
        )
        logits = self._logits(rows, tokens, positions, self_mask, source_len).float()
        best = logits.argmax(dim=-1)
        chosen = torch.where(finished, self.pad_id, best)
        # Each running row's summed log-probability of its tokens: the answer's confidence.
        logprob = logits.log_softmax(dim=-1).gather(1, best[:, None])[:, 0]
        self.logprob[:rows].add_(logprob.masked_fill_(finished, 0.0))
        is_eos = (chosen[:, None] == self.eos_ids).any(dim=-1)
        # The row's token count after this one; at its limit it ends like an EOS.
        ends = is_eos | (positions + 1 >= self.limits[:rows])
        newly = ends & ~finished
        self.finished_at[:rows].copy_(torch.where(newly, positions, self.finished_at[:rows]))
        self.output[:rows].scatter_(1, (positions + 1)[:, None], chosen[:, None])
        positions.add_((~finished).long())
        finished |= ends
        tokens.copy_(chosen)
        if not self.use_cuda_graphs:
            for slot in self._live:
                self._slot_steps[slot] += 1

    # -- CUDA graphs ---------------------------------------------------------

    def _runner(self, bucket: int) -> Callable[[], None]:
        """The bucket's step: a graph replay when one is (or can be) captured, else eager."""
        if self.use_cuda_graphs and bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph = self._graphs.get(bucket)
        if graph is not None:
            return graph.replay
        return lambda: self._steps(bucket)

    def _steps(self, bucket: int) -> None:
        for _ in range(self.steps_per_run):
            self._step(bucket)

    def _capture_encoder(self, key: tuple[int, ...]) -> _EncoderGraph | None:
        """One encoder graph for `rows` inputs of (channels, height, width), or None. The
        graphs of one shape share its lane's input, output and memory pool."""
        try:
            rows, *shape = key
            lane = self._lane(tuple(shape))
            inputs = lane.inputs[:rows]
            if lane.kv is None:
                kv_shape = list(self.cross_k.shape)
                kv_shape[-2] = self._encode(inputs[:1]).shape[-2]  # the source length
                lane.kv = torch.empty((2, *kv_shape), device=self.device, dtype=self.dtype)
            out = lane.kv[:, :, :rows]
            graph = capture_graph(
                lambda: out.copy_(self._encode(inputs)),
                lane.graphs,
                self.device,
                warm=lambda: self._encode(inputs),
                warmups=2,
            )
            return _EncoderGraph(graph, inputs, out)
        except Exception as exc:  # this shape encodes eagerly instead
            if not self._warned_capture:
                logger.warning("CUDA graph capture failed (%s); encoding eagerly", exc)
                self._warned_capture = True
            return None

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        """Warm the step up on a side stream, then capture it into the shared memory pool."""
        try:
            if self._family is None:
                self._family = GraphFamily.on(self.device)
            return capture_graph(
                lambda: self._steps(bucket),
                self._family,
                self.device,
                warm=lambda: self._step(bucket),
                warmups=3,
            )
        except Exception as exc:  # any capture failure falls back to eager decoding
            if not self._warned_capture:
                logger.warning("CUDA graph capture failed (%s); decoding eagerly", exc)
                self._warned_capture = True
            return None


class _Projection:
    """`x @ weight.T + bias`, one linear layer of a decoding step.

    `blocked` (a bf16 model on a CPU with oneDNN): the weight is reordered once into
    oneDNN's blocked layout, which `F.linear` would do again on every call; for the one
    to sixteen rows of a CPU step that about halves the time of the step's multiplies
    (training/formula/NOTES.md), with the same bf16 results.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, blocked: bool) -> None:
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.blocked = None
        if blocked and torch.backends.mkldnn.is_available():
            with contextlib.suppress(AttributeError, RuntimeError):  # a build without them
                self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, "none", [], "")


@dataclass(frozen=True)
class _StepLinears:
    """The linear layers one decoder layer runs at every step."""

    qkv: _Projection  # self-attention Q, K and V as one matrix
    self_out: _Projection
    cross_q: _Projection
    cross_out: _Projection
    fc1: _Projection
    fc2: _Projection

    @classmethod
    def of(cls, layer: nn.Module, blocked: bool) -> _StepLinears:
        def projection(linear: nn.Linear) -> _Projection:
            return _Projection(linear.weight, linear.bias, blocked)

        return cls(
            qkv=_Projection(*_fused_projection(layer.self_attn), blocked),
            self_out=projection(layer.self_attn.out_proj),
            cross_q=projection(layer.encoder_attn.q_proj),
            cross_out=projection(layer.encoder_attn.out_proj),
            fc1=projection(layer.fc1),
            fc2=projection(layer.fc2),
        )


def _fused_projection(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of `attn`'s q_proj, k_proj and v_proj stacked into one linear."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = torch.cat([p.weight for p in projections]).detach()
    biases = [p.bias for p in projections]
    if all(b is None for b in biases):
        return weight, None
    bias = torch.cat(
        [
            b if b is not None else torch.zeros_like(p.weight[:, 0])
            for b, p in zip(biases, projections, strict=True)
        ]
    ).detach()
    return weight, bias


@dataclass(frozen=True)
class Finished:
    """A row's tokens, start token first, through its end token (or its limit)."""

    tokens: list[int]
    logprob: float  # the sum of the log-probabilities of the tokens it chose

    @property
    def generated(self) -> int:
        """The tokens it generated, its end token included (all but the start token)."""
        return len(self.tokens) - 1


@dataclass(frozen=True)
class Decoded:
    """What `decode()` returns: rows of tokens as `generate()` gives them, and each row
    as it finished."""

    tokens: torch.Tensor  # [batch, T], start token first, padded after each row's end
    rows: list[Finished]


@dataclass(frozen=True)
class Snapshot:
    """Every running row's state at one point of the device's queue (see `snapshot()`)."""

    state: torch.Tensor  # host [rows, 2 + cache], per slot [finished, finished_at, *output]
    logprobs: torch.Tensor  # host [rows], per slot the summed log-probability of its tokens
    ready: torch.cuda.Event | None  # recorded after the copies (CUDA); None: already there
    rows: dict[int, int]  # slot -> the epoch of the row it held

    def host(self) -> torch.Tensor:
        """The state on the host, once its copy is done."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.state


@dataclass
class _Lane:
    """One encoder input shape's CUDA stream, and what its graphs share: the input rows,
    the K/V they write (allocated at the first capture), and their family (memory pool
    and capture stream, so their cuBLAS workspace). Shapes do not share these, so two
    shapes' graphs, and the decoding steps' own, can run at once."""

    stream: torch.cuda.Stream
    graphs: GraphFamily
    inputs: torch.Tensor  # [max_batch, channels, height, width]
    kv: torch.Tensor | None = None  # [2, layers, max_batch, heads, S, D]


class _EncoderGraph:
    """A captured encoder call: copy rows into its input, replay, read the K/V view."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: torch.Tensor, kv: torch.Tensor):
        self.graph = graph
        self.inputs = inputs
        self.kv = kv

    def run(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.inputs[: pixel_values.shape[0]].copy_(pixel_values)
        self.graph.replay()
        return self.kv
