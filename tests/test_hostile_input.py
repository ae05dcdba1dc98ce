"""What a hostile client sends, against a real server on a socket: oversized chunked
bodies, deep JSON, odd bytes in headers, slow clients, huge heads, too many connections.
Every case gets a documented JSON error or a closed connection, never a 5xx or a hang."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from app.http import BODY_BUDGET_UPLOADS
from app.settings import Settings
from tests.conftest import ServerProcess, formula_png, wait_for

KEY = "hostile-suite-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
UPLOAD_LIMIT = 128 * 1024
REQUEST_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def hostile(tiny_env) -> Iterator[ServerProcess]:
    """A server with API keys, small bodies, a short request timeout and a small
    connection cap, so that every bound is reached in a fraction of a second."""
    proc = ServerProcess(
        {
            **tiny_env,
            "TEXEL_API_KEYS": KEY,
            "TEXEL_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT),
            "TEXEL_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
            "TEXEL_ADVANCED__MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        }
    )
    yield proc
    proc.stop()


# -- a small raw HTTP client: what httpx will not send ------------------------------


def connect(server: ServerProcess, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(method: str, path: str, headers: dict[str, str] | list[tuple[str, str]]) -> bytes:
    items = headers.items() if isinstance(headers, dict) else headers
    lines = [f"{method} {path} HTTP/1.1", "Host: texel", *(f"{k}: {v}" for k, v in items)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunked(body: bytes, size: int = 16 * 1024) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def code(self) -> str:
        error = json.loads(self.body)["error"]
        assert set(error) == {"code", "message"}, error
        return error["code"]


def read_answer(sock: socket.socket) -> Answer:
    """One response: its status line, headers and a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed without an answer after {data!r}")
        data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Answer(int(status_line.split()[1]), headers, body[:length])


def exchange(server: ServerProcess, request: bytes) -> Answer:
    with connect(server) as sock:
        sock.sendall(request)
        return read_answer(sock)


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (reading anything it sends)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


# -- bodies over the size limit, streamed without a Content-Length ------------------


def test_a_chunked_body_that_passes_its_limit_is_answered_at_once_not_at_the_timeout(hostile):
    """Refused as it passes its limit, a body's rest is not waited for: a client that
    then pauses gets its 413 at once, not at the request timeout, and the connection
    closes."""
    request = head(
        "POST", "/recognize", {**AUTH, "Content-Type": "image/png", "Transfer-Encoding": "chunked"}
    )
    over = b"\x89PNG" + b"\0" * UPLOAD_LIMIT
    with connect(hostile) as sock:
        sock.sendall(request + b"%x\r\n%s\r\n" % (len(over), over))  # no last chunk
        started = time.monotonic()
        answer = read_answer(sock)
        assert time.monotonic() - started < REQUEST_TIMEOUT_S / 2
        assert answer.status == 413 and answer.code() == "payload_too_large"
        assert answer.headers.get("connection") == "close"


def test_a_chunked_multipart_upload_over_the_limit_gets_413(hostile):
    boundary = "texelboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="f.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + b"\x89PNG"
        + b"\0" * (3 * UPLOAD_LIMIT)
    )
    headers = {
        **AUTH,
        "Content-Type": f"multipart/form-data; boundary={boundary}",
        "Transfer-Encoding": "chunked",
    }
    answer = exchange(hostile, head("POST", "/recognize", headers) + chunked(body))
    assert answer.status == 413
    assert answer.code() == "payload_too_large"


def test_a_chunked_json_upload_over_the_limit_gets_413(hostile):
    body = b'{"image_base64": "' + b"A" * (3 * UPLOAD_LIMIT) + b'"}'
    headers = {**AUTH, "Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    for path in ("/recognize", "/generate"):
        answer = exchange(hostile, head("POST", path, headers) + chunked(body))
        assert answer.status == 413, path
        assert answer.code() == "payload_too_large", path


# -- JSON nested deeper than any parser should follow -------------------------------


def test_deeply_nested_json_gets_a_clear_400_on_both_routes(hostile):
    deep = b"[" * 30_000 + b"]" * 30_000  # within every route's body limit
    with hostile.client(headers=AUTH) as client:
        for path in ("/recognize", "/generate"):
            response = client.post(path, content=deep, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["code"] == "malformed_request"
            assert "JSON" in response.json()["error"]["message"]


def test_a_body_of_many_unknown_fields_gets_a_short_422_on_every_route(hostile):
    """Listing each of 5,000 unknown fields took the event loop's time and answered
    several times the body's size; the answer counts them instead."""
    fields = ",".join(f'"f{i}":0' for i in range(5_000))
    bodies = {
        "/recognize": '{"image_base64":"AA",' + fields + "}",
        "/generate": '{"prompt":"a red circle",' + fields + "}",
        "/v1/images/generations": '{"prompt":"a red circle",' + fields + "}",
    }
    with hostile.client(headers=AUTH) as client:
        for path, body in bodies.items():
            assert len(body) < 64 * 1024  # within every route's body limit: parsed
            response = client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 422, (path, response.text[:200])
            assert response.json()["error"]["code"] == "invalid_parameter"
            assert len(response.content) < 1000, (path, len(response.content))
            assert "5000 fields" in response.json()["error"]["message"]
        # A few are still named one by one.
        body = {"prompt": "a red circle", "width": "64", "colour": "red"}
        message = client.post("/generate", json=body).json()["error"]["message"]
        assert "width" in message and "colour" in message


def test_a_body_of_an_image_route_only_may_be_the_size_of_an_image(hostile):
    """/generate and /v1/images/generations take a prompt and a few numbers: a body of
    megabytes there is refused from its size, not read and parsed."""
    body = {"prompt": "a red circle", "negative_prompt": "x" * (UPLOAD_LIMIT // 2)}
    with hostile.client(headers=AUTH) as client:
        for path in ("/generate", "/v1/images/generations"):
            response = client.post(path, json=body)
            assert response.status_code == 413, (path, response.text[:200])
            assert response.json()["error"]["code"] == "payload_too_large"


# -- odd bytes in the Authorization header ------------------------------------------


def test_an_authorization_header_with_non_ascii_bytes_gets_401(hostile):
    for path, method in (
        ("/recognize", "POST"),
        ("/generate", "POST"),
        ("/debug/bottleneck", "GET"),
    ):
        request = head(
            method, path, {"Authorization": "Bearer \xff\xe9t\xe9", "Content-Length": "0"}
        )
        answer = exchange(hostile, request)
        assert answer.status == 401, path
        assert answer.code() == "unauthorized"


def test_the_right_key_still_opens_the_door(hostile):
    response = httpx.get(hostile.url + "/debug/bottleneck?window_s=0.5", headers=AUTH)
    assert response.status_code == 200, response.text


# -- slow clients ---------------------------------------------------------------------


def test_a_body_that_trickles_in_is_answered_408_and_closed_at_the_request_timeout(hostile):
    request = head(
        "POST",
        "/recognize",
        {**AUTH, "Content-Type": "application/json", "Content-Length": "10000"},
    )
    with connect(hostile) as sock:
        sock.sendall(request + b'{"image_base64": "')
        started = time.monotonic()
        sock.settimeout(0.2)
        answer = None
        while answer is None and time.monotonic() - started < 3 * REQUEST_TIMEOUT_S:
            try:
                sock.sendall(b"A")
                sock.settimeout(0.2)
                answer = read_answer(sock)
            except TimeoutError:
                continue
        elapsed = time.monotonic() - started
        assert answer is not None, "the server kept reading a body that never ends"
        assert answer.status == 408 and answer.code() == "request_timeout"
        assert elapsed < REQUEST_TIMEOUT_S + 1.5
        assert answer.headers.get("connection") == "close"
        assert closed_by_server(sock, within_s=2)


def test_a_head_that_trickles_in_is_answered_408_and_closed_at_the_request_timeout(hostile):
    with connect(hostile) as sock:
        sock.sendall(b"POST /recognize HTTP/1.1\r\nHost: texel\r\nX-Slow: ")
        started = time.monotonic()
        answer = None
        while answer is None and time.monotonic() - started < 3 * REQUEST_TIMEOUT_S:
            try:
                sock.sendall(b"a")
                sock.settimeout(0.2)
                answer = read_answer(sock)
            except TimeoutError:
                continue
        assert answer is not None, "the server kept reading a head that never ends"
        assert answer.status == 408 and answer.code() == "request_timeout"
        assert time.monotonic() - started < REQUEST_TIMEOUT_S + 1.5
        assert closed_by_server(sock, within_s=2)


@pytest.mark.parametrize("after_a_request", [False, True], ids=["new", "kept alive"])
def test_blank_lines_without_a_request_do_not_hold_a_connection_open(hostile, after_a_request):
    """HTTP lets a client send blank lines before a request; a connection that sends
    one and nothing more is closed at the request timeout, as a head that never ends
    is, and cannot take one of the server's connections for ever."""
    with connect(hostile) as sock:
        if after_a_request:  # blank lines before a request are still taken
            sock.sendall(b"\r\n\r\n" + head("GET", "/livez", {}))
            assert read_answer(sock).status == 200
        sock.sendall(b"\r\n")
        started = time.monotonic()
        assert closed_by_server(sock, within_s=REQUEST_TIMEOUT_S + 3)
        assert time.monotonic() - started < REQUEST_TIMEOUT_S + 1.5


def test_a_refusal_before_the_body_is_read_still_reaches_the_client_and_keeps_it(hostile):
    """Refused before its body is read (here: no API key), a request's whole body is read
    and dropped first: closing a socket that holds unread bytes makes the kernel reset
    the connection, and a client uploading a picture got no answer at all."""
    body = b'{"image_base64": "' + b"A" * UPLOAD_LIMIT + b'"}'  # more than uvicorn buffers
    request = head(
        "POST", "/recognize", {"Content-Type": "application/json", "Content-Length": str(len(body))}
    )
    with connect(hostile) as sock:
        sock.sendall(request + body)
        for _ in range(3):  # the connection stays open for the next request
            answer = read_answer(sock)
            assert answer.status == 401 and answer.code() == "unauthorized"
            assert answer.headers.get("connection") != "close"
            sock.sendall(request + body)


def test_a_refused_body_sent_slowly_cannot_keep_its_connection_open(hostile):
    """... but a body that stops arriving is read no longer than the request timeout: its
    refusal goes out then, and the connection closes."""
    request = head(
        "POST", "/recognize", {"Content-Type": "application/json", "Content-Length": "5000"}
    )
    with connect(hostile) as sock:
        sock.sendall(request + b'{"image_base64": ')
        started = time.monotonic()
        answer = read_answer(sock)
        assert answer.status == 401
        assert time.monotonic() - started < REQUEST_TIMEOUT_S + 1.5
        assert answer.headers.get("connection") == "close"
        assert closed_by_server(sock, within_s=2)


def test_a_client_that_waits_to_send_its_body_is_refused_without_it(hostile):
    """With `Expect: 100-continue` the client sends its body only once told to: refused
    first, it is answered at once and never asked for the body."""
    request = head(
        "POST",
        "/recognize",
        {"Content-Type": "application/json", "Content-Length": "5000", "Expect": "100-continue"},
    )
    with connect(hostile) as sock:
        sock.sendall(request)
        answer = read_answer(sock)
        assert answer.status == 401
        assert answer.headers.get("connection") == "close"


# -- heads too large ------------------------------------------------------------------


def test_a_head_over_its_size_limit_gets_431(hostile):
    answer = exchange(hostile, head("GET", "/livez", {"X-Big": "a" * 200_000}))
    assert answer.status == 431
    assert answer.code() == "headers_too_large"


@pytest.mark.parametrize(
    "headers",
    [{"X-Big": "a" * 70_000}, {"X-Big-1": "a" * 40_000, "X-Big-2": "a" * 40_000}],
    ids=["one header", "two headers"],
)
def test_a_head_just_over_its_size_limit_gets_431_even_when_it_arrives_whole(hostile, headers):
    request = head("GET", "/livez", headers)
    assert 64 * 1024 < len(request) < 96 * 1024
    answer = exchange(hostile, request)
    assert answer.status == 431
    assert answer.code() == "headers_too_large"


def test_a_head_just_under_its_size_limit_is_served(hostile):
    answer = exchange(hostile, head("GET", "/livez", {"X-Big": "a" * 60_000}))
    assert answer.status == 200


def test_a_head_with_too_many_headers_gets_431(hostile):
    answer = exchange(hostile, head("GET", "/livez", [(f"X-H{i}", "1") for i in range(500)]))
    assert answer.status == 431
    assert answer.code() == "headers_too_large"


def test_malformed_http_gets_a_json_400(hostile):
    answer = exchange(hostile, b"GET /livez HTTP/1.1\r\nHost texel\r\n\r\n")
    assert answer.status == 400
    assert answer.code() == "malformed_http"


@pytest.mark.parametrize(
    "body",
    [b"ZZZ\r\nabc\r\n0\r\n\r\n", b"5\r\n{}\r\n0\r\n\r\n"],
    ids=["chunk size not hex", "chunk shorter than its size"],
)
def test_a_malformed_chunked_body_gets_a_json_400(hostile, body):
    request = head(
        "POST",
        "/recognize",
        {**AUTH, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
    )
    with connect(hostile) as sock:
        sock.sendall(request + body)
        answer = read_answer(sock)
        assert answer.status == 400
        assert answer.code() == "malformed_http"
        assert answer.headers.get("connection") == "close"
        assert closed_by_server(sock, within_s=2)


# -- the bodies a process holds at once ------------------------------------------------


def recognize_raw(png: bytes, chunks: bool = False) -> bytes:
    headers = {"Content-Type": "image/png"}
    headers["Transfer-Encoding" if chunks else "Content-Length"] = (
        "chunked" if chunks else str(len(png))
    )
    return head("POST", "/recognize", headers) + (chunked(png) if chunks else png)


def rejected_for_uploads(server: ServerProcess) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("texel_requests_rejected_total{") and 'reason="uploads"' in line
    )


def test_bodies_past_the_process_budget_are_refused_unread_until_a_held_one_is_answered(server):
    """The shared server takes uploads of 256 KiB: `BODY_BUDGET_UPLOADS` bodies of that
    size, sent but for their last byte, all but fill its budget; then any other body, one
    with a `Content-Length` or a chunked one, is answered 503, until one of the held
    requests ends. Heads alone hold nothing of it."""
    limit = 256 * 1024
    png = formula_png()
    rejected_before = rejected_for_uploads(server)
    held = []
    try:
        for _ in range(BODY_BUDGET_UPLOADS):  # heads alone: a small upload is still read
            sock = connect(server)
            upload = {"Content-Type": "image/png", "Content-Length": str(limit)}
            sock.sendall(head("POST", "/recognize", upload))
            held.append(sock)
        assert exchange(server, recognize_raw(png)).status == 200
        for sock in held:
            sock.sendall(png + bytes(limit - 1 - len(png)))
        # The server takes the held requests up in its own time: until it has, a small
        # upload fits and is answered.
        deadline = time.monotonic() + 15
        while (answer := exchange(server, recognize_raw(png))).status == 200:
            assert time.monotonic() < deadline, "the held bodies never filled the budget"
        assert answer.status == 503 and answer.code() == "too_many_uploads"
        assert answer.headers.get("retry-after") == "1"
        # A chunked body, which declares no size, is refused at its first chunk.
        answer = exchange(server, recognize_raw(png, chunks=True))
        assert answer.status == 503 and answer.code() == "too_many_uploads"
        assert rejected_for_uploads(server) >= rejected_before + 2
    finally:
        held.pop().close()  # its request ends (the client went away): its share frees
    try:
        wait_for(lambda: exchange(server, recognize_raw(png)).status == 200, timeout=15)
    finally:
        for sock in held:
            sock.close()


def test_the_settings_name_the_budget_the_server_keeps():
    description = Settings.model_fields["max_upload_bytes"].description
    assert f"at most {BODY_BUDGET_UPLOADS} times it" in description


# -- connections ----------------------------------------------------------------------


def test_connections_beyond_the_cap_get_503_and_the_cap_frees_as_they_close(hostile):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = connect(hostile)
            sock.sendall(head("GET", "/livez", {}))
            assert read_answer(sock).status == 200
            held.append(sock)
        with connect(hostile) as extra:
            extra.sendall(head("GET", "/livez", {}))
            assert read_answer(extra).status == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(hostile.url + "/livez").status_code != 200:
        assert time.monotonic() < deadline, "closed connections were not released"
        time.sleep(0.05)


def test_the_server_is_healthy_after_every_hostile_case(hostile):
    assert httpx.get(hostile.url + "/readyz").status_code == 200
    assert "Traceback" not in hostile.log(tail=100_000)
