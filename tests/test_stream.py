"""Continuous batching (`batching.stream`): requests join a running stream and leave it
as they finish, with fake models, and the formula model served that way."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from batching import Batcher, BatchFailed, BatchPolicy, Worker

CHECK_S = 0.005


class FakeStream:
    """A payload (value, steps) decodes for `steps` checks of CHECK_S, then answers
    value * 2. Holds at most `rows` at once; "boom" fails the stream, "forget" is never
    answered."""

    def __init__(self, rows: int = 4) -> None:
        self.rows = rows
        self.most = 0  # the most rows it held at once
        self.joins: list[int] = []  # how many joined at each check where some did
        self.cancelled: list[int] = []

    def __call__(self, feed) -> None:
        running: dict[int, list] = {}  # key -> [value, steps left]
        while True:
            new = feed.take(self.rows - len(running))
            if new:
                self.joins.append(len(new))
            for key, payload in new:
                if payload == "boom":
                    raise RuntimeError("boom in the stream")
                if payload == "forget":
                    return
                running[key] = list(payload)
            self.most = max(self.most, len(running))
            if not running:
                if feed.finish():
                    return
                continue
            time.sleep(CHECK_S)
            answers = []
            for key, row in list(running.items()):
                row[1] -= 1
                if row[1] <= 0:
                    answers.append((key, row[0] * 2))
                    del running[key]
            for key in feed.cancelled(list(running)):
                self.cancelled.append(key)
                answers.append((key, ValueError("cancelled")))
                del running[key]
            if answers:
                feed.done(answers)


def _no_batches(payloads, should_stop):
    raise AssertionError("a streaming worker must not run plain batches")


def make_batcher(stream, rows: int = 4, **policy) -> Batcher:
    settings = dict(max_batch_size=rows, max_wait_s=0.001, max_queue=64, merge_buckets=True)
    worker = Worker("cpu", _no_batches, stream=stream)
    batcher = Batcher("fake", [worker], BatchPolicy(**{**settings, **policy}))
    batcher.start()
    return batcher


async def _short_ones_overtake_a_long_one(batcher: Batcher, stream: FakeStream | None) -> None:
    long = asyncio.create_task(batcher.submit((100, 200), bucket=1, timeout_s=30))
    await asyncio.sleep(0.1)  # it is decoding
    assert not long.done()
    shorts = [
        asyncio.create_task(batcher.submit((i, 3), bucket=i % 3, timeout_s=30)) for i in range(9)
    ]
    results = await asyncio.gather(*shorts)
    assert [r.value for r in results] == [i * 2 for i in range(9)]
    assert not long.done(), "short requests joined the running stream and answered first"
    assert all(r.batch_size <= 4 for r in results)
    assert max(r.batch_size for r in results) >= 2
    assert (await long).value == 200
    if stream is not None:
        assert stream.most == 4, "never more rows than max_batch_size"
        assert len(stream.joins) >= 3, "rows joined at several checks"


async def test_requests_join_a_running_stream_and_leave_as_they_finish():
    stream = FakeStream()
    batcher = make_batcher(stream)
    await _short_ones_overtake_a_long_one(batcher, stream)
    # The stream ended once idle; a new request starts another.
    assert (await batcher.submit((5, 1), bucket=0, timeout_s=5)).value == 10
    assert await batcher.drain(5)
    await batcher.close()


async def test_a_lone_request_starts_a_stream_at_once_and_later_ones_join_it():
    stream = FakeStream()
    batcher = make_batcher(stream, max_wait_s=5.0)  # a batch would wait 5 s for company
    started = time.monotonic()
    first = asyncio.create_task(batcher.submit((1, 20), bucket=0, timeout_s=30))
    await asyncio.sleep(0.02)
    second = await batcher.submit((2, 1), bucket=1, timeout_s=30)
    assert second.value == 4
    assert second.batch_size == 2, "it joined the running stream"
    assert (await first).value == 2
    assert time.monotonic() - started < 2.0, "no request waited max_wait_s"
    assert stream.joins == [1, 1]
    await batcher.close()


async def test_a_failing_stream_fails_its_requests_and_the_next_one_starts_afresh():
    batcher = make_batcher(FakeStream())
    long = asyncio.create_task(batcher.submit((1, 100), bucket=0, timeout_s=30))
    await asyncio.sleep(0.05)
    with pytest.raises(BatchFailed, match="boom in the stream"):
        await batcher.submit("boom", bucket=0, timeout_s=5)
    with pytest.raises(BatchFailed, match="boom in the stream"):
        await long  # it was running in the stream that failed
    assert (await batcher.submit((4, 1), bucket=0, timeout_s=5)).value == 8
    await batcher.close()


async def test_a_stream_that_ends_without_answering_fails_the_request_instead_of_losing_it():
    batcher = make_batcher(FakeStream())
    with pytest.raises(BatchFailed, match="without answering"):
        await batcher.submit("forget", bucket=0, timeout_s=5)
    assert (await batcher.submit((3, 1), bucket=0, timeout_s=5)).value == 6
    await batcher.close()


async def test_a_cancelled_request_leaves_the_running_stream():
    stream = FakeStream()
    batcher = make_batcher(stream)
    stays = asyncio.create_task(batcher.submit((1, 40), bucket=0, timeout_s=30))
    goes = asyncio.create_task(batcher.submit((2, 10_000), bucket=0, timeout_s=30))
    await asyncio.sleep(0.05)
    goes.cancel()
    assert (await stays).value == 2
    assert len(stream.cancelled) == 1, "the stream dropped the row whose client went away"
    assert await batcher.drain(5), "nothing left running"
    await batcher.close()


async def test_drain_waits_for_every_request_in_a_stream():
    batcher = make_batcher(FakeStream())
    tasks = [
        asyncio.create_task(batcher.submit((i, 5 + 5 * i), bucket=0, timeout_s=30))
        for i in range(6)
    ]
    await asyncio.sleep(0.02)
    assert await batcher.drain(10)
    assert [t.result().value for t in tasks] == [i * 2 for i in range(6)]
    await batcher.close()


# -- the formula model, served -------------------------------------------------

TEXTS = ["x^2 + 1", "a + b = c", "\\frac{1}{2}", "e^{i\\pi}", "y = mx + b", "n!"]


def recognize_all(proc, images: list[bytes]) -> list[str]:
    """The LaTeX a server answers for each image, all sent at once."""

    def one(data: bytes) -> str:
        with proc.client() as client:
            response = client.post("/recognize", files={"image": ("f.png", data, "image/png")})
        assert response.status_code == 200, response.text
        return response.json()["latex"]

    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        return list(pool.map(one, images))


def test_continuous_batching_serves_the_same_answers_as_whole_batches(start_server):
    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import formula_png

    images = [formula_png(text, size=(100 + 60 * i, 48)) for i, text in enumerate(TEXTS * 2)]
    answers = {}
    for continuous in ("true", "false"):
        server = start_server(  # formulas only: no image model to load and warm up
            TEXEL_FORMULA__ADVANCED__CONTINUOUS=continuous,
            TEXEL_FORMULA__MAX_BATCH_SIZE="4",
            TEXEL_IMAGE__ENABLED="false",
        )
        answers[continuous] = recognize_all(server, images)
        with server.client() as client:
            text = client.get("/metrics").text
        server.stop()
        sizes = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "texel_batch_size"
            for sample in family.samples
            if sample.labels.get("model") and sample.name.endswith(("_count", "_sum"))
        }
        mean = sizes["texel_batch_size_sum"] / sizes["texel_batch_size_count"]
        assert 1 <= mean <= 4, sizes
    assert answers["true"] == answers["false"]


async def test_two_devices_each_run_a_stream_once_the_first_is_full():
    """Two devices (fake): the first stream takes requests up to its rows, the rest
    start a stream on the second device instead of waiting; every answer is right."""
    streams = [FakeStream(rows=4), FakeStream(rows=4)]
    workers = [Worker(f"dev{i}", _no_batches, stream=stream) for i, stream in enumerate(streams)]
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.001, max_queue=64, merge_buckets=True)
    batcher = Batcher("two", workers, policy)
    batcher.start()
    results = await asyncio.gather(
        *(batcher.submit((i, 20), bucket=0, timeout_s=30) for i in range(8))
    )
    assert [r.value for r in results] == [i * 2 for i in range(8)]
    assert {r.worker for r in results} == {"dev0", "dev1"}
    assert [s.most for s in streams] == [4, 4], "each device ran a full stream"
    assert await batcher.drain(5)
    await batcher.close()


async def test_requests_go_to_the_device_with_the_least_predicted_work_not_the_fewest_requests():
    """Two devices (fake): one holds a single expensive request, the other cheap ones;
    new cheap requests keep going to the second while its queued cost is the lower."""
    streams = [FakeStream(rows=8), FakeStream(rows=8)]
    workers = [Worker(f"dev{i}", _no_batches, stream=stream) for i, stream in enumerate(streams)]
    policy = BatchPolicy(max_batch_size=8, max_wait_s=0.001, max_queue=64, merge_buckets=True)
    batcher = Batcher("two", workers, policy)
    batcher.start()
    expensive = asyncio.create_task(batcher.submit((0, 60), bucket=0, cost=10.0, timeout_s=30))
    await asyncio.sleep(0.02)
    cheap = []
    for i in range(1, 6):  # each one queued alone, the others still decoding
        cheap.append(asyncio.create_task(batcher.submit((i, 40), bucket=0, timeout_s=30)))
        await asyncio.sleep(0.01)
    results = await asyncio.gather(*cheap)
    first = await expensive
    assert [r.value for r in results] == [2 * i for i in range(1, 6)]
    assert {r.worker for r in results} == {"dev1"} != {first.worker}, (
        "five cheap requests cost less than the expensive one's 10"
    )
    await batcher.close()


async def test_a_stream_that_fails_before_taking_fails_its_requests_at_once():
    """Not queued again (a worker that cannot start would loop until the deadline)."""
    calls = []

    def broken(feed) -> None:
        calls.append(1)
        raise RuntimeError("cannot start the worker")

    batcher = make_batcher(broken)
    with pytest.raises(BatchFailed, match="cannot start the worker"):
        await batcher.submit((1, 1), bucket=0, timeout_s=30)
    assert len(calls) == 1
    await batcher.close()
