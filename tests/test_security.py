"""What a client on the network can reach on a real server with API keys: which routes a
key guards, that an empty token opens nothing, and the headers that keep browsers from
reading Texel's answers as something else."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request

from app.errors import ApiError
from app.http import check_api_key
from tests.conftest import ROOT, ServerProcess, formula_png

KEY = "security-suite-key"
GUARDED = [
    ("POST", "/recognize"),
    ("POST", "/generate"),
    ("POST", "/v1/images/generations"),
    ("GET", "/v1/models"),
    ("GET", "/debug/bottleneck?window_s=0.5"),
]


@pytest.fixture(scope="module")
def keyed(tiny_env) -> Iterator[ServerProcess]:
    """A server with an API key. Keys are checked before readiness, so the models need
    not have loaded."""
    proc = ServerProcess(
        {**tiny_env, "TEXEL_API_KEYS": KEY, "TEXEL_IMAGE__ENABLED": "false"},
        wait_ready=False,
    )
    yield proc
    proc.stop()


@pytest.mark.parametrize("authorization", ["Bearer", "bearer"])
def test_an_empty_bearer_token_is_refused_on_every_guarded_route(keyed, authorization):
    with keyed.client(headers={"Authorization": authorization}) as client:
        for method, path in GUARDED:
            response = client.request(method, path, json={})
            assert response.status_code == 401, (path, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
    with keyed.client(headers={"Authorization": f"Bearer {KEY}"}) as client:  # the real key
        assert client.get("/debug/bottleneck?window_s=0.5").status_code == 200
        assert client.post("/recognize", json={}).status_code != 401


def texel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TEXEL_API_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_client_commands_send_the_key_from_the_environment(keyed):
    """`texel diagnose` and `texel recognize` take the key from TEXEL_API_KEY, so that it
    need not be on a command line, where `ps` shows it."""
    diagnose = ("diagnose", "--url", keyed.url, "--window", "0.5")
    refused = texel(*diagnose, env={})
    assert refused.returncode == 1 and "answered 401" in refused.stderr, refused.stderr
    answered = texel(*diagnose, env={"TEXEL_API_KEY": KEY})
    assert answered.returncode == 0 and "quadrant:" in answered.stdout, answered.stderr


def test_texel_recognize_stops_at_once_on_a_missing_or_wrong_key(keyed, tmp_path):
    """One line saying what to do, not one error line per picture."""
    picture = tmp_path / "f.png"
    picture.write_bytes(formula_png())
    for env, says in (
        ({}, "wants an API key"),
        ({"TEXEL_API_KEY": "wrong"}, "refused the API key"),
    ):
        done = texel("recognize", str(picture), "--url", keyed.url, env=env)
        assert done.returncode != 0 and done.stdout == "", done
        assert f"{says}: set TEXEL_API_KEY (or pass --api-key)" in done.stderr, done.stderr


def test_an_empty_key_opens_nothing_even_if_one_reached_the_check():
    """`texel serve` refuses an empty key at start (tests/test_startup_errors.py); the
    check itself does not take an empty token for one either."""
    request = Request({"type": "http", "headers": [(b"authorization", b"Bearer")]})
    with pytest.raises(ApiError) as refused:
        check_api_key(request, [KEY, ""])
    assert refused.value.status == 401


def test_every_answer_tells_browsers_not_to_sniff_its_type(keyed):
    with keyed.client() as client:
        answers = [
            client.get("/"),
            client.get("/static/texel.js"),
            client.get("/livez"),
            client.get("/metrics"),
            client.get("/no-such-route"),
            client.post("/recognize", json={}),  # 401
        ]
    for answer in answers:
        assert answer.headers.get("x-content-type-options") == "nosniff", answer.request.url
    # A body refused by its Content-Length, before the app reads it.
    # And those answered by the server before any app: malformed HTTP, a head too large.
    for request, status in (
        (b"POST /recognize HTTP/1.1\r\nHost: t\r\nContent-Length: 99999999\r\n\r\n", b"413"),
        (b"GET / HTTP/1.1\r\nHost t\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
    ):
        with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
            sock.sendall(request)
            head = sock.recv(65536).split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 " + status)
        assert b"x-content-type-options: nosniff" in head, head


def test_the_page_runs_only_its_own_scripts_and_is_not_framed(keyed):
    policy = httpx.get(keyed.url + "/").headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["script-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"
    docs = httpx.get(keyed.url + "/docs").headers["content-security-policy"]
    assert "frame-ancestors 'none'" in docs
