"""Formula images decoded in worker processes (`TEXEL_PREPROCESS_PROCESSES`), on a real server."""

from __future__ import annotations

import concurrent.futures
import signal

import psutil

from tests.conftest import formula_png
from tests.test_api import decompression_bomb

TEXTS = ["x^2 + 1", "a + b = c", "\\frac{1}{2}", "e^{i\\pi}", "y = mx + b", "n!"]


def recognize_all(proc, images: list[bytes]) -> list[str]:
    def one(data: bytes) -> str:
        with proc.client() as client:
            response = client.post("/recognize", files={"image": ("f.png", data, "image/png")})
        assert response.status_code == 200, response.text
        return response.json()["latex"]

    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        return list(pool.map(one, images))


def formulas_and_threaded_answers(start_server) -> tuple[list[bytes], list[str]]:
    """Six rendered formulas and what a server with default settings answers for them."""
    images = [formula_png(text, size=(120 + 40 * i, 48)) for i, text in enumerate(TEXTS)]
    threads = start_server(TEXEL_FORMULA__MAX_WAIT_MS="50")
    expected = recognize_all(threads, images)
    threads.stop()
    return images, expected


def spawned_workers(proc) -> list[psutil.Process]:
    """The server's spawned child processes."""
    children = psutil.Process(proc.process.pid).children(recursive=True)
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def test_worker_processes_give_the_same_answers_and_the_same_errors(start_server):
    images, expected = formulas_and_threaded_answers(start_server)
    processes = start_server(TEXEL_PREPROCESS_PROCESSES="2", TEXEL_FORMULA__MAX_WAIT_MS="50")
    workers = spawned_workers(processes)
    assert len(workers) == 2, [c.cmdline() for c in workers]
    assert recognize_all(processes, images) == expected

    with processes.client() as client:  # an error raised in a worker process is still a 4xx
        truncated = client.post("/recognize", files={"image": ("f.png", images[0][:200])})
        assert truncated.status_code == 400, truncated.text
        assert truncated.json()["error"]["code"] == "corrupt_image"
        bomb = client.post("/recognize", files={"image": ("b.png", decompression_bomb(9000, 9000))})
        assert bomb.status_code == 413, bomb.text
        not_image = client.post("/recognize", files={"image": ("f", b"plain text")})
        assert not_image.status_code == 415, not_image.text
        again = client.post("/recognize", files={"image": ("f.png", images[0], "image/png")})
        assert again.status_code == 200 and again.json()["latex"] == expected[0]

    processes.stop(signal.SIGKILL)  # killed outright, the workers still go
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [p.pid for p in alive]
