"""The recognition cache: the LRU itself, then /recognize on real servers answering the same
image bytes from it without reaching the batcher."""

from __future__ import annotations

import tracemalloc

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.launcher import single_process_app
from app.recognition_cache import MIB, RecognitionCache
from app.settings import Settings
from telemetry import add_span_processor
from tests.conftest import formula_png
from tests.server import serving_in_thread

# -- the LRU -----------------------------------------------------------------------------


def fill(cache: RecognitionCache, count: int) -> list[bytes]:
    keys = [cache.key(f"image {i}".encode(), "formula") for i in range(count)]
    for i, key in enumerate(keys):
        cache.put(key, f"x ^ {i}", f"x^{i}")
    return keys


def test_the_cache_stays_within_its_byte_budget_dropping_the_least_recently_used():
    cache = RecognitionCache(max_bytes=2000)
    keys = fill(cache, 40)
    assert 0 < cache.nbytes <= 2000
    assert 0 < len(cache) < 40
    kept = [key for key in keys if cache.get(key) is not None]
    assert kept == keys[-len(cache) :]  # the newest ones, the oldest dropped


def test_putting_past_the_budget_reports_how_many_answers_were_dropped():
    cache = RecognitionCache(max_bytes=2000)
    fill(cache, 40)
    before = len(cache)
    evicted = cache.put(cache.key(b"one more", "formula"), "y", "y")
    assert evicted >= 1 and len(cache) == before + 1 - evicted


def test_reading_an_answer_keeps_it_over_older_ones():
    cache = RecognitionCache(max_bytes=2000)
    keys = fill(cache, 40)
    oldest, second = keys[-len(cache)], keys[-len(cache) + 1]
    assert cache.get(oldest) is not None
    assert cache.put(cache.key(b"newcomer", "formula"), "z ^ 9", "z^9") >= 1
    assert cache.get(oldest) is not None
    assert cache.get(second) is None


@pytest.mark.parametrize("length", [0, 20, 100])
def test_a_full_cache_holds_no_more_memory_than_its_budget(length):
    """What the cache counts against what Python allocates for it (tracemalloc): keys,
    strings, confidences, its entries and the room its tables keep spare, full of
    answers of `length` characters."""
    budget = 4 * MIB
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = RecognitionCache(max_bytes=budget)
        for i in range(4 * budget // 300):  # more than fit: it is full, and evicting
            latex = f"{i:08d}" + "x" * length
            cache.put(cache.key(latex.encode(), "formula"), latex, latex.replace("x", "y"), i / 7)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.nbytes <= budget
    assert held <= budget, f"{held / budget:.2f} times its budget, {len(cache)} answers"


def test_a_budget_of_zero_stores_nothing():
    cache = RecognitionCache.of_megabytes(0)
    key = cache.key(b"image", "formula")
    cache.put(key, "x", "x")
    assert not cache.enabled and cache.get(key) is None and len(cache) == 0


def test_keys_differ_by_bytes_model_and_decoding_settings():
    greedy, beams = RecognitionCache(1000, variant=(1,)), RecognitionCache(1000, variant=(4,))
    keys = {
        greedy.key(b"image", "formula"),
        greedy.key(b"image!", "formula"),
        greedy.key(b"image", "other-model"),
        beams.key(b"image", "formula"),
    }
    assert len(keys) == 4
    assert greedy.key(b"image", "formula") == RecognitionCache(5, variant=(1,)).key(
        b"image", "formula"
    )


# -- on the shared server ------------------------------------------------------------------


def recognize(url: str, data: bytes) -> httpx.Response:
    files = {"image": ("f.png", data, "image/png")}
    return httpx.post(url + "/recognize", files=files, timeout=60)


def test_the_same_image_again_is_answered_from_the_cache_as_it_was_computed(server):
    data = formula_png("cache: same answer")
    computed = recognize(server.url, data).json()
    cached = recognize(server.url, data).json()
    assert (computed["cached"], cached["cached"]) == (False, True)
    fields = ("latex", "latex_compact", "confidence", "model")
    assert {f: cached[f] for f in fields} == {f: computed[f] for f in fields}


def test_a_cached_answer_does_not_reach_the_batcher(server):
    data = formula_png("cache: no batch")
    assert recognize(server.url, data).json()["batch_size"] >= 1
    batches = server.metric("texel_batch_size_count", model="formula")
    waits = server.metric("texel_stage_duration_seconds_count", stage="queue.wait")
    body = recognize(server.url, data).json()
    assert body["batch_size"] == 0 and set(body["timings_ms"]) == {"http.parse"}
    assert server.metric("texel_batch_size_count", model="formula") == batches
    assert server.metric("texel_stage_duration_seconds_count", stage="queue.wait") == waits


def test_lookups_count_as_a_miss_then_a_hit_in_metrics(server):
    hits = server.metric("texel_recognition_cache_hits_total", model="formula")
    misses = server.metric("texel_recognition_cache_misses_total", model="formula")
    data = formula_png("cache: counted")
    recognize(server.url, data)
    recognize(server.url, data)
    assert server.metric("texel_recognition_cache_misses_total", model="formula") == misses + 1
    assert server.metric("texel_recognition_cache_hits_total", model="formula") == hits + 1


def test_a_failed_recognition_is_not_cached(server):
    truncated = formula_png("cache: broken")[:120]
    hits = server.metric("texel_recognition_cache_hits_total", model="formula")
    answers = [recognize(server.url, truncated) for _ in range(2)]
    assert [r.status_code for r in answers] == [400, 400]
    assert {r.json()["error"]["code"] for r in answers} == {"corrupt_image"}
    assert server.metric("texel_recognition_cache_hits_total", model="formula") == hits


# -- on a server of a small cache, traced --------------------------------------------------

# A few answers of the tiny model fit; a handful of distinct images overflow it.
SMALL_CACHE_MB = 1200 / 2**20


def in_process(settings: Settings):
    """The one-process app of `settings` on a socket: its URL."""
    return serving_in_thread(single_process_app(settings))


@pytest.fixture(scope="module")
def small_cache(tiny_models):
    exporter = InMemorySpanExporter()
    settings = Settings(
        device="cpu",
        formula={
            "model": str(tiny_models["formula"]),
            "max_wait_ms": 0,
            "cache_mb": SMALL_CACHE_MB,
        },
        image={"enabled": False, "model": str(tiny_models["image"])},
    )
    add_span_processor(SimpleSpanProcessor(exporter))
    with in_process(settings) as url:
        yield url, exporter


def test_an_answer_dropped_past_the_byte_budget_is_computed_again(small_cache):
    url, _ = small_cache
    images = [formula_png(f"evict {i}") for i in range(5)]
    for data in images:
        assert recognize(url, data).json()["cached"] is False
    assert recognize(url, images[-1]).json()["cached"] is True  # the newest is held
    again = recognize(url, images[0]).json()  # the oldest was dropped
    assert again["cached"] is False and again["batch_size"] >= 1


def test_the_request_span_says_whether_the_cache_answered(small_cache):
    url, exporter = small_cache
    data = formula_png("traced cache")
    exporter.clear()
    for _ in range(2):
        recognize(url, data)
    hits = [
        span.attributes["texel.cache.hit"]
        for span in exporter.get_finished_spans()
        if "texel.cache.hit" in (span.attributes or {})
    ]
    assert hits == [False, True]
