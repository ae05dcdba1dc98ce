"""POST /generate as server-sent events: progress at every step, then the image."""

from __future__ import annotations

import base64
import io
import json
import socket

import httpx
from PIL import Image

from tests.conftest import wait_for

PROMPT = {"prompt": "a red circle on a blue background", "seed": 5}


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a text/event-stream answer, in order."""
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            out.append((name, json.loads(line.removeprefix("data: "))))
    return out


def streamed(server, **params) -> list[tuple[str, dict]]:
    with (
        server.client() as client,
        client.stream(
            "POST", "/generate", json={**PROMPT, **params}, headers={"Accept": "text/event-stream"}
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return events(response)


def check_progress_then_image(server, steps: int) -> None:
    got = streamed(server, num_inference_steps=steps)
    names = [name for name, _ in got]
    assert names[-1] == "image" and set(names[:-1]) == {"progress"}
    progress = [data for _, data in got[:-1]]
    assert progress[0]["step"] == 0 and progress[0]["queue_position"] >= 0
    assert [p["step"] for p in progress[1:]] == list(range(1, steps + 1))
    assert all(p["total"] == steps for p in progress)
    # The image is the one the same request gets as JSON.
    with server.client() as client:
        plain = client.post("/generate", json={**PROMPT, "num_inference_steps": steps}).json()
    image = got[-1][1]["images"][0]
    assert image["seed"] == 5 and image["png_base64"] == plain["images"][0]["png_base64"]
    assert Image.open(io.BytesIO(base64.b64decode(image["png_base64"]))).format == "PNG"


def test_a_streamed_generation_reports_every_step_then_its_image(server):
    check_progress_then_image(server, steps=6)


def test_progress_crosses_the_engine_protocol_from_an_engine_process(start_server):
    server = start_server(TEXEL_HTTP_PROCESSES="2", TEXEL_FORMULA__ENABLED="false")
    check_progress_then_image(server, steps=4)


def test_a_request_the_stages_refuse_gets_its_status_not_a_stream(server):
    with server.client() as client:
        response = client.post(
            "/generate",
            json={**PROMPT, "width": 33},
            headers={"Accept": "text/event-stream"},
        )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_parameter"


def test_a_client_that_leaves_the_stream_stops_its_generation(server):
    cancelled = server.metric("texel_requests_rejected_total", reason="cancelled")
    body = json.dumps({**PROMPT, "num_inference_steps": 100}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Accept: text/event-stream\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    seen = b""
    while b'"step":1,' not in seen:  # it is running
        chunk = sock.recv(65536)
        assert chunk, "the stream ended early"
        seen += chunk
    sock.close()
    wait_for(
        lambda: server.metric("texel_requests_rejected_total", reason="cancelled") > cancelled,
        timeout=20,
    )
    # Its rows leave the loop at its next step, which may come after the count above.
    wait_for(lambda: server.metric("texel_denoising_used_images") == 0, timeout=20)
    # Its rows left the loop: a new request runs alone in it.
    with server.client() as client:
        alone = client.post("/generate", json={**PROMPT, "num_inference_steps": 2}).json()
    assert alone["batch_size"] == 1
