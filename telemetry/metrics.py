"""Every Prometheus metric Texel exports, with its buckets, in one place.

Names follow Prometheus conventions (base units, `_seconds`, `_total`). In one process
the metrics live in Texel's own registry, so `/metrics` shows exactly these plus the
process collector (and exemplars, with OpenMetrics). With several processes (HTTP
processes, engine processes) the launcher sets `PROMETHEUS_MULTIPROC_DIR` and every
process records into it (prometheus_client's multiprocess mode): `/metrics` in any
HTTP process then shows the sum over all of them. Exemplars need one process:
prometheus_client keeps none in multiprocess mode.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
REGISTRY = CollectorRegistry(auto_describe=True)
if not MULTIPROCESS:
    ProcessCollector(registry=REGISTRY)

# Per-stage and per-request latencies: from the tens of microseconds of a formula's
# response stages on a GPU box to image generation on a CPU, which may take up to the
# request deadline (TEXEL_REQUEST_TIMEOUT_S, 60 s by default) and a 504 just past it.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
    0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 20.0, 40.0, 60.0, 120.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
EFFICIENCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TOKEN_BUCKETS = (1, 5, 10, 20, 40, 60, 80, 120, 160, 240, 320, 512)
PER_TOKEN_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25)
CONFIDENCE_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 1.0)
# A denoising step of a batch: milliseconds with CUDA graphs on a GPU, seconds on a CPU.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)

STAGE_DURATION = Histogram(
    "texel_stage_duration_seconds",
    "Time spent in one stage of a request (http.parse, preprocess, tokenize, "
    "queue.wait, generate, postprocess).",
    ["model", "stage"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "texel_request_duration_seconds",
    "End-to-end time of an inference request, by route and HTTP status.",
    ["route", "status"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "texel_queue_wait_seconds",
    "Time a request waited in the batcher before its batch started.",
    ["model"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "texel_batch_size",
    "Requests per executed batch; with continuous batching, the rows decoding together "
    "once new requests joined.",
    ["model"],
    buckets=BATCH_SIZE_BUCKETS,
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "texel_queue_depth",
    "Requests waiting for a batch.",
    ["model"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
INFLIGHT = Gauge(
    "texel_inflight_requests",
    "Requests being handled right now, by route.",
    ["route"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
PADDING_EFFICIENCY = Histogram(
    "texel_padding_efficiency",
    "Real over padded input elements per batch (1.0 means no padding).",
    ["model"],
    buckets=EFFICIENCY_BUCKETS,
    registry=REGISTRY,
)
REJECTION_REASONS = (
    "queue_full",
    "deadline",
    "cancelled",
    "invalid",
    "draining",
    "not_ready",
    "unavailable",
    "uploads",
    "failed",
)
REJECTED = Counter(
    "texel_requests_rejected",
    f"Requests refused or abandoned, by reason ({', '.join(REJECTION_REASONS)}).",
    ["model", "reason"],
    registry=REGISTRY,
)
OUTPUT_TOKENS = Histogram(
    "texel_output_tokens",
    "Tokens generated per recognized formula.",
    ["model"],
    buckets=TOKEN_BUCKETS,
    registry=REGISTRY,
)
CONFIDENCE = Histogram(
    "texel_confidence",
    "How sure the model was of each answer it read (the geometric mean of its tokens' "
    "probabilities): a falling median says the pictures sent are getting harder to read.",
    ["model"],
    buckets=CONFIDENCE_BUCKETS,
    registry=REGISTRY,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "texel_time_per_output_token_seconds",
    "Batch decode time divided by the longest output in the batch.",
    ["model"],
    buckets=PER_TOKEN_BUCKETS,
    registry=REGISTRY,
)
DENOISING_STEP = Histogram(
    "texel_denoising_step_seconds",
    "Time of one denoising step of a batch.",
    ["model"],
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
IMAGES_GENERATED = Counter(
    "texel_images_generated",
    "Images returned by /generate.",
    ["model"],
    registry=REGISTRY,
)
RECOGNITION_CACHE_HITS = Counter(
    "texel_recognition_cache_hits",
    "/recognize requests answered from the recognition cache of their HTTP process.",
    ["model"],
    registry=REGISTRY,
)
RECOGNITION_CACHE_MISSES = Counter(
    "texel_recognition_cache_misses",
    "/recognize requests looked up in the recognition cache and not found there.",
    ["model"],
    registry=REGISTRY,
)
RECOGNITION_CACHE_EVICTIONS = Counter(
    "texel_recognition_cache_evictions",
    "Answers dropped from a recognition cache, least recently used first, to stay within "
    "TEXEL_FORMULA__CACHE_MB.",
    ["model"],
    registry=REGISTRY,
)
EVENT_LOOP_LAG = Histogram(
    "texel_event_loop_lag_seconds",
    "How late the event loop ran a timer that was due (sampled every 100 ms). Lag "
    "means requests wait for the loop: it is busy, or other threads hold the GIL.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    registry=REGISTRY,
)
GC_PAUSE = Histogram(
    "texel_gc_pause_seconds",
    "Collections of Python's cyclic garbage collector in an HTTP process, by generation: "
    "every thread of the process waits while one runs (TEXEL_ADVANCED__GC_FREEZE).",
    ["generation"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    registry=REGISTRY,
)
GC_FROZEN = Gauge(
    "texel_gc_frozen_objects",
    "Objects each process put out of the garbage collector's reach once ready "
    "(TEXEL_ADVANCED__GC_FREEZE; 0 when off), summed over processes.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
LOOP_BUDGET = Gauge(
    "texel_denoising_budget_images",
    "Images of the default size a running denoising loop may hold (TEXEL_IMAGE__MAX_BATCH_SIZE), "
    "by device.",
    ["model", "device"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
LOOP_USED = Gauge(
    "texel_denoising_used_images",
    "Images of the default size in the running denoising loop (larger images count for "
    "their pixels), by device.",
    ["model", "device"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
STREAM_CHECKS = Counter(
    "texel_stream_checks",
    "Looks of a model's running stream at its rows (where finished rows leave and new ones "
    "join), by whether another model is on the same GPU (company: shared, when the "
    "formula stream looks half as often, or alone).",
    ["model", "company"],
    registry=REGISTRY,
)
DEVICE_SECONDS = Counter(
    "texel_device_seconds",
    "Device time of each model's batches and stream steps, by device: on a GPU from CUDA "
    "events on the model's stream, so the work of two models that overlaps counts for "
    "both; wall time on a CPU.",
    ["model", "device"],
    registry=REGISTRY,
)
MODEL_READY = Gauge(
    "texel_model_ready",
    "1 once a model is loaded and warmed up (in at least one engine), 0 while it loads "
    "and after it failed to.",
    ["model"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
HTTP_PROCESSES = Gauge(
    "texel_http_processes",
    "Processes answering HTTP on Texel's port (TEXEL_HTTP_PROCESSES).",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
TORCH_ALLOCATED = Gauge(
    "texel_torch_allocated_bytes",
    "Bytes held by tensors (torch allocator), by device.",
    ["device"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
TORCH_RESERVED = Gauge(
    "texel_torch_reserved_bytes",
    "Bytes reserved by the torch allocator, by device.",
    ["device"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)


def series_from_zero(model: str) -> None:
    """In an HTTP process: `model`'s rejection series at 0, so that `rate()` and
    `increase()` see its first refusal of each reason; and its readiness and queue depth
    at 0, which the engines' values add to (`livemax`, `livesum`), so that while its
    engine starts again they read 0 (not ready, nothing queued) rather than no data,
    which an alert on `texel_model_ready == 0` or an autoscaler would not see."""
    for reason in REJECTION_REASONS:
        REJECTED.labels(model, reason)
    MODEL_READY.labels(model).set(0)
    QUEUE_DEPTH.labels(model).set(0)


def record_allocator(device) -> None:
    """Set the torch-allocator gauges of a CUDA `device` from this process's allocator (an
    engine process's, which only it can read); nothing for other devices."""
    torch = sys.modules.get("torch")
    if torch is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return
    TORCH_ALLOCATED.labels(str(device)).set(torch.cuda.memory_allocated(device))
    TORCH_RESERVED.labels(str(device)).set(torch.cuda.memory_reserved(device))


def _resources():
    from telemetry.resources import ResourceCollector

    return ResourceCollector()


# One (NVML initializes once per process), and kept out of REGISTRY: reading its CPU
# gauge starts the gauge's next window, so only /metrics reads it.
_RESOURCES = _resources()


def registry(resources: bool = True) -> CollectorRegistry:
    """What /metrics shows: this process's registry, or every process's samples, and the
    machine gauges read at scrape time unless `resources` is False (for a reader other
    than a scrape, which would shorten the next scrape's CPU window)."""
    merged = CollectorRegistry()
    if MULTIPROCESS:
        MultiProcessCollector(merged)
    else:
        merged.register(REGISTRY)
    if resources:
        merged.register(_RESOURCES)
    return merged


def families(resources: bool = True) -> Iterator[Metric]:
    """Every metric family /metrics would show (`registry`)."""
    return registry(resources).collect()


def exposition(accept_header: str | None) -> tuple[bytes, str]:
    """Render the metrics as Prometheus text, or OpenMetrics (with exemplars) if asked."""
    encoder, content_type = choose_encoder(accept_header or "")
    return encoder(registry()), content_type
