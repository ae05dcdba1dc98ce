"""`texel serve` with two HTTP processes and an engine process (TEXEL_HTTP_PROCESSES=2).

The launcher starts one engine process and two HTTP processes that share the port
(SO_REUSEPORT) and reach the engine over its Unix socket. These tests run real servers
on real sockets: one port answered by both processes, metrics summed over them,
readiness read from the engine, and what a client sees when a process dies or the
launcher is told to stop.

A server costs seconds of CPU to start, so the file starts two, side by side: the
read-only checks share one; the tests that kill a process share the other, each leaving
it whole again, and the last test stops it. The heartbeat test starts a third of its
own, for its short request timeout.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from app.server import ConnectionShare
from app.serving import FOLLOW_S
from tests.conftest import formula_png, wait_for
from tests.fixtures import weightless_copy
from tests.server import ROOT, ServerProcess

HTTP_PROCESSES = 2


# -- finding the processes -------------------------------------------------------------


def _children(server: ServerProcess) -> list[psutil.Process]:
    try:
        return psutil.Process(server.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def http_processes(server: ServerProcess) -> list[psutil.Process]:
    """The launcher's processes listening on the server's port: its HTTP processes."""
    found = []
    for child in _children(server):
        try:
            sockets = child.net_connections("tcp")
        except psutil.Error:  # gone meanwhile
            continue
        if any(s.status == psutil.CONN_LISTEN and s.laddr.port == server.port for s in sockets):
            found.append(child)
    return found


def engine_process(server: ServerProcess) -> psutil.Process | None:
    """The launcher's process serving the engine's Unix socket."""
    for child in _children(server):
        try:
            sockets = child.net_connections("unix")
        except psutil.Error:
            continue
        if any(s.laddr.endswith("/engine-0.sock") for s in sockets):
            return child
    return None


def gone(process: psutil.Process) -> bool:
    """Exited (a zombie not yet reaped has closed its sockets too)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_whole(server: ServerProcess, timeout: float = 120) -> None:
    """Until both HTTP processes listen and count themselves in /metrics."""
    wait_for(
        lambda: (
            len(http_processes(server)) == HTTP_PROCESSES
            and server.metric("texel_http_processes") == HTTP_PROCESSES
        ),
        timeout,
    )


def start(tiny_env: dict[str, str], **env: str) -> ServerProcess:
    """A server with two HTTP processes, once it answers /livez."""
    env = {**tiny_env, "TEXEL_HTTP_PROCESSES": str(HTTP_PROCESSES), **env}
    return ServerProcess(env, wait_ready=False)


# -- requests ------------------------------------------------------------------------


def recognize(server: ServerProcess, timeout: float = 60, text: str = "x^2 + 1") -> httpx.Response:
    """One formula, on a new connection: the kernel may hand it to either process (and
    its recognition cache answers a picture it has read before)."""
    files = {"image": ("f.png", formula_png(text), "image/png")}
    return httpx.post(server.url + "/recognize", files=files, timeout=timeout)


def recognize_many(server: ServerProcess, count: int, concurrency: int = 6) -> list:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: recognize(server), range(count)))


def recognized(server: ServerProcess) -> float:
    return server.metric("texel_request_duration_seconds_count", route="/recognize", status="200")


def readiness(server: ServerProcess) -> tuple[int, dict]:
    """/readyz on a new connection; an answer that takes seconds fails the test."""
    response = httpx.get(server.url + "/readyz", timeout=5)
    return response.status_code, response.json()


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


# -- the two servers of this file --------------------------------------------------------

GRACE_S, DRAIN_S = 2.0, 10.0
WAITING = {"prompt": "a square", "num_inference_steps": 2}  # waits 3 s in the engine


@dataclass
class Restartable:
    server: ServerProcess
    startup_readiness: list[tuple[int, dict]]  # every /readyz answer from /livez to ready


def readiness_until_ready(server: ServerProcess, timeout: float = 180) -> list[tuple[int, dict]]:
    """Every /readyz answer until the first 200 (each on a new connection)."""
    answers = []
    deadline = time.monotonic() + timeout
    while not answers or answers[-1][0] != 200:
        assert time.monotonic() < deadline, f"not ready in {timeout} s:\n{server.log()}"
        answers.append(readiness(server))
        time.sleep(0.2)
    return answers


def start_restartable(tiny_env: dict[str, str]) -> Restartable:
    server = start(
        tiny_env,
        TEXEL_IMAGE__MAX_WAIT_MS="3000",
        # Whole batches, so that the wait holds images in the queue (a denoising loop
        # would take them at once).
        TEXEL_IMAGE__ADVANCED__CONTINUOUS="false",
        TEXEL_SHUTDOWN_GRACE_S=str(GRACE_S),
        TEXEL_DRAIN_TIMEOUT_S=str(DRAIN_S),
    )
    try:
        return Restartable(server, readiness_until_ready(server))
    except BaseException:
        server.stop(signal.SIGKILL)
        raise


@pytest.fixture(scope="module")
def starting(tiny_env, tmp_path_factory):
    """Both servers, started side by side (a start-up keeps about one core busy)."""
    missing = weightless_copy(  # an image model that fails to load
        Path(tiny_env["TEXEL_IMAGE__MODEL"]), tmp_path_factory.mktemp("models") / "weightless"
    )
    pool = concurrent.futures.ThreadPoolExecutor(2)
    futures = {
        "shared": pool.submit(
            start,
            tiny_env,
            TEXEL_IMAGE__MODEL=str(missing),
            TEXEL_FORMULA__MAX_WAIT_MS="50",
            TEXEL_ADVANCED__KEEP_ALIVE_S="1",
        ),
        "restartable": pool.submit(start_restartable, tiny_env),
    }
    pool.shutdown(wait=False)
    yield futures
    for future in futures.values():
        if future.exception() is None:
            started = future.result()
            (started.server if isinstance(started, Restartable) else started).stop()


@pytest.fixture(scope="module")
def shared(starting) -> ServerProcess:
    """For read-only checks: the formula model ready, an image model that could not
    load, and idle connections closed after 1 s."""
    server = starting["shared"].result()
    wait_whole(server)
    wait_for(lambda: readiness(server)[1]["models"]["formula"] == "ready", timeout=120)
    return server


@pytest.fixture(scope="module")
def restartable(starting) -> Restartable:
    """Both models; an image waits 3 s in the engine's queue for company (requests that
    stay in flight without costing CPU). Each test leaves it whole; the last stops it."""
    return starting["restartable"].result()


# -- one port, two processes: read-only checks on a shared server ------------------------


def test_both_http_processes_take_connections_on_the_one_port(shared):
    # Sixteen connections, held open: the kernel hands each to one listening process.
    sockets = [socket.create_connection(("127.0.0.1", shared.port), timeout=10) for _ in range(16)]
    try:
        held: dict[int, int] = {}

        def all_accepted() -> bool:
            held.clear()
            for process in http_processes(shared):
                held[process.pid] = sum(
                    1
                    for s in process.net_connections("tcp")
                    if s.status == psutil.CONN_ESTABLISHED and s.laddr.port == shared.port
                )
            return sum(held.values()) == 16

        wait_for(all_accepted, timeout=10)
        assert len(held) == HTTP_PROCESSES
        assert all(held.values()), held  # 2 / 2**16 odds that the kernel gave one process all
        for sock in sockets:  # and each process answers on the connections it holds
            sock.sendall(b"GET /livez HTTP/1.1\r\nHost: texel\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in sockets:
            sock.close()


def test_a_second_server_on_the_port_is_refused_not_handed_half_its_connections(shared, tiny_env):
    # SO_REUSEPORT would let it bind beside the first and take its share of connections.
    command = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1"]
    second = subprocess.run(
        [*command, "--port", str(shared.port)],
        env={**os.environ, **tiny_env, "TEXEL_HTTP_PROCESSES": str(HTTP_PROCESSES)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 1, second.stderr
    refusal = f"cannot serve on 127.0.0.1:{shared.port}: already served by another Texel"
    assert refusal in second.stderr
    assert "Traceback" not in second.stderr
    assert httpx.get(shared.url + "/livez").status_code == 200  # the first one is untouched


def test_a_new_server_removes_the_folders_of_killed_ones_and_only_those(tmp_path):
    from app.launcher import hold_folder, remove_orphans

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"texel-{gone.pid}-x1"  # its launcher was SIGKILLed
    running = tmp_path / f"texel-{os.getpid()}-x2"
    # A live server in another container: its PID is none of ours, its lock is held.
    elsewhere = tmp_path / f"texel-{gone.pid}-x3"
    # A dead server whose PID has been reused by another process: its lock is free.
    reused = tmp_path / f"texel-{os.getpid()}-x4"
    unlocked = tmp_path / f"texel-{gone.pid}-x5"  # an older Texel's: no lock, PID gone
    for folder in (orphan, running, elsewhere, reused, unlocked):
        (folder / "metrics").mkdir(parents=True)
    held = [hold_folder(str(folder)) for folder in (running, elsewhere)]
    (orphan / "lock").touch()
    (reused / "lock").touch()
    log = tmp_path / "texel-test-8000.log"
    log.write_text("not a server's folder")

    remove_orphans(str(tmp_path))

    assert not orphan.exists() and not reused.exists() and not unlocked.exists()
    assert running.exists() and elsewhere.exists() and log.exists()
    for lock in held:
        lock.close()


def test_connection_share_lets_go_of_what_is_over_an_eighth_above_the_even_split():
    table = [0, 0, 0, 0]
    share = ConnectionShare(table, 0)
    table[1:] = [20, 20, 20]
    for _ in range(40):
        share.opened()
    # 100 open over 4 processes: 25 each, and an eighth more (28.125) may stay; the
    # connections told to leave are counted as gone at once.
    assert [share.over() for _ in range(15)] == [True] * 12 + [False] * 3
    for _ in range(12):
        share.closed(leaving=True)
    assert table[0] == 28 and share.leaving == 0
    table[1:] = [24, 24, 24]  # the clients' new connections, placed elsewhere
    assert not share.over()
    share.opened()  # and one placed here again
    assert share.over()


def _holder(server: ServerProcess, client_port: int) -> int | None:
    """The HTTP process holding the connection from `client_port`, once it accepted it."""
    for process in http_processes(server):
        for s in process.net_connections("tcp"):
            if s.status == psutil.CONN_ESTABLISHED and s.raddr and s.raddr.port == client_port:
                return process.pid
    return None


def _held(server: ServerProcess) -> dict[int, int]:
    """Established connections to the port per HTTP process."""
    return {
        process.pid: sum(
            1
            for s in process.net_connections("tcp")
            if s.status == psutil.CONN_ESTABLISHED and s.laddr.port == server.port
        )
        for process in http_processes(server)
    }


def test_a_process_with_more_than_its_share_of_connections_hands_some_back(restartable):
    # Twelve kept-alive connections that the kernel all gave to one process (others are
    # closed until it holds twelve; on the server that keeps idle connections as long as
    # by default): each answers requests, and the busy process closes connections after
    # an answer until it holds no more than its share (6 + 1 here); clients open new
    # ones, as HTTP clients do, and the kernel places them again.
    server = restartable.server
    clients: list[http.client.HTTPConnection] = []
    first = None
    while len(clients) < 12:
        client = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        client.connect()
        port = client.sock.getsockname()[1]
        wait_for(lambda port=port: _holder(server, port), timeout=10)
        holder = _holder(server, port)
        first = first or holder
        if holder == first:
            clients.append(client)
        else:
            client.close()
    try:
        closed = 0
        for _ in range(30):
            for client in clients:
                client.request("GET", "/livez")
                response = client.getresponse()
                assert response.status == 200
                response.read()
                closed += response.will_close
            for client in clients:
                if client.sock is None:  # closed by the server after its answer
                    client.connect()
            wait_for(lambda: sum(_held(server).values()) >= 12, timeout=10)
            held = _held(server)
            if max(held.values()) <= sum(held.values()) / 2 + 1:
                break
        assert max(held.values()) <= sum(held.values()) / 2 + 1, held
        assert closed >= 5, closed  # 12 on one process down to at most 7
    finally:
        for client in clients:
            client.close()


def test_the_http_processes_count_themselves_in_metrics(shared):
    # Each read may land on either process; both show the sum over processes.
    assert [shared.metric("texel_http_processes") for _ in range(4)] == [HTTP_PROCESSES] * 4


def test_ps_tells_the_processes_apart(shared):
    """Every child's command line is multiprocessing's; its name says what it is."""
    assert sorted(p.name() for p in http_processes(shared)) == ["texel-http-0", "texel-http-1"]
    assert engine_process(shared).name() == "texel-cpu"
    # The engine and HTTP processes are forked by the launcher's fork server.
    assert engine_process(shared).parent().name() == "texel-fork"


def test_the_launcher_holds_no_torch(shared):
    """The launcher plans and supervises; torch is its children's. It imported torch to
    learn the devices (about 200 MB and 5 CPU-seconds of a process that runs no model)."""
    launcher = psutil.Process(shared.process.pid)
    mapped = {m.path for m in launcher.memory_maps()}
    assert not [path for path in mapped if "libtorch" in path]
    # The children it serves with do load it: the check above can tell.
    assert [p for p in {m.path for m in engine_process(shared).memory_maps()} if "libtorch" in p]


def test_the_launcher_says_the_models_load_after_the_port_opens(shared):
    assert "loading the models: GET /readyz answers 200 once they are ready" in shared.log(10**7)


def test_requests_answered_by_either_process_add_up_in_metrics(shared):
    before = recognized(shared)
    responses = recognize_many(shared, 12)
    failed = [r.text for r in responses if r.status_code != 200]
    assert not failed, failed
    assert len({r.json()["latex"] for r in responses}) == 1  # same picture, same answer
    assert [recognized(shared) - before for _ in range(4)] == [12] * 4


def test_the_engine_processs_device_time_reaches_either_http_processs_metrics(shared):
    def device_s() -> float:
        return shared.metric("texel_device_seconds_total", device="cpu")

    before = device_s()
    files = [{"image": ("f.png", formula_png(f"d^{i}"), "image/png")} for i in range(3)]
    for one in files:  # three pictures: none answered from a recognition cache
        assert httpx.post(shared.url + "/recognize", files=one, timeout=60).status_code == 200
    # New connections, so either process answers; both show the engine's one counter
    # (once its stream's last step, credited just after the last answer, is in).
    wait_for(lambda: len({device_s() for _ in range(4)}) == 1, timeout=10)
    assert device_s() > before


def test_bad_input_is_refused_alike_by_either_process(shared):
    before = shared.metric("texel_requests_rejected_total", reason="invalid")
    bad = [
        httpx.post(shared.url + "/recognize", files={"image": ("f.png", b"not a picture")})
        for _ in range(6)
    ]
    assert {(r.status_code, error_code(r)) for r in bad} == {(415, "unsupported_image")}
    assert shared.metric("texel_requests_rejected_total", reason="invalid") - before == 6


def test_a_model_that_failed_to_load_is_reported_failed_by_either_process(shared):
    for _ in range(6):  # new connections: either process may answer
        status, body = readiness(shared)
        assert status == 503 and body["models"] == {"formula": "ready", "image": "failed"}
        image = httpx.post(shared.url + "/generate", json={"prompt": "x"})
        assert image.status_code == 503 and error_code(image) == "model_failed"
    assert [r.status_code for r in recognize_many(shared, 6)] == [200] * 6


def _idle_connection_closed(server: ServerProcess, idle_s: float) -> bool:
    """Whether the server closes a kept-alive connection left idle for `idle_s`."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        connection.request("GET", "/livez")
        first = connection.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        time.sleep(idle_s)
        try:
            connection.request("GET", "/livez")
            return connection.getresponse().status != 200
        except (http.client.RemoteDisconnected, ConnectionError):
            return True
    finally:
        connection.close()


def test_http_processes_close_idle_connections_after_the_keep_alive_setting(shared):
    # TEXEL_ADVANCED__KEEP_ALIVE_S=1 here; uvicorn's own default would keep them 5 s.
    assert _idle_connection_closed(shared, 2.5)


# -- processes that die, and a stop: on the restartable server -------------------------


def generate(server: ServerProcess) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=WAITING, timeout=60)


def test_readyz_is_503_until_the_engine_has_every_model_ready_then_200(restartable):
    *loading, (status, ready) = restartable.startup_readiness
    for status_before, body in loading:
        assert status_before == 503 and body["ready"] is False, body
        assert set(body["models"]) == {"formula", "image"}
        assert set(body["models"].values()) <= {"unavailable", "loading", "ready"}, body
        assert set(body["models"].values()) != {"ready"}, body
    assert status == 200 and ready == {
        "ready": True,
        "draining": False,
        "models": {"formula": "ready", "image": "ready"},
    }


def new_http_process(server: ServerProcess, old: set[int], timeout: float) -> int:
    """The pid of an HTTP process not in `old`, the moment it listens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if new := {p.pid for p in http_processes(server)} - old:
            return new.pop()
        time.sleep(0.025)
    raise AssertionError(f"no new HTTP process in {timeout} s:\n{server.log()}")


def test_a_killed_http_process_is_replaced_and_no_request_fails_meanwhile(restartable):
    server = restartable.server
    wait_whole(server)
    first = {p.pid for p in http_processes(server)}
    done = recognized(server)
    victim = http_processes(server)[0]
    victim.kill()
    wait_for(lambda: gone(victim), timeout=10)
    # Counted out once the launcher has seen it die; what it answered still counts.
    wait_for(lambda: server.metric("texel_http_processes") == 1, timeout=10)
    assert recognized(server) == done

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        # The other process answers while the launcher starts a new one...
        meanwhile = list(pool.map(lambda _: recognize(server), range(6)))
        # ...which answers from its first connection on: a burst the moment it listens.
        replacement = new_http_process(server, first, timeout=120)
        burst = list(pool.map(lambda _: recognize(server), range(16)))
    statuses = [r.status_code for r in meanwhile + burst]
    assert statuses == [200] * 22, [r.text for r in meanwhile + burst if r.status_code != 200]
    wait_whole(server)
    assert {p.pid for p in http_processes(server)} == first - {victim.pid} | {replacement}
    assert recognized(server) == done + 22
    assert re.search(rf"texel-http-\d+ \(pid {victim.pid}\) exited with code -9", server.log(10**7))


def test_a_child_that_shows_no_life_for_its_hang_time_is_killed_and_started_again(caplog):
    """Stopped (or deadlocked), an HTTP process kept its share of the port's connections
    and answered none, and nothing noticed. Each now beats as its event loop goes round
    (`Runtime._beat`); here a real child whose beats stop, as the launcher checks it."""
    from app.launcher import _Child

    last = [0.0]
    child = _Child("texel-http-0", time.sleep, (3600,), beat=lambda: last[0], hang_s=0.5)
    child.start()
    first = child.process
    try:
        child.check(time.monotonic())  # no beat yet: still starting
        last[0] = time.monotonic()
        child.check(time.monotonic())  # beating
        assert first.is_alive()
        time.sleep(0.6)
        with caplog.at_level(logging.ERROR, logger="texel"):
            child.check(time.monotonic())
        assert not first.is_alive()
        said = rf"texel-http-0 \(pid {first.pid}\) has shown no sign of life"
        assert re.search(said, caplog.text)
        child.check(time.monotonic() + 30)  # past the back-off of a quick death
        assert child.process is not first and child.process.is_alive()
    finally:
        for process in (first, child.process):
            if process.is_alive():
                process.kill()


def test_a_stopped_http_process_or_engine_is_replaced_for_its_silence_and_the_rest_kept(
    tiny_env,
):
    """The test above checks the launcher against a child made to look hung; nothing
    checked that a real HTTP process beats at all (`run_http_process` hands its `Runtime`
    the launcher's slot). Here, on a server of its own whose hang time is 6 s (twice a
    3 s request timeout), one HTTP process SIGSTOPped is killed for its silence and
    replaced, while the other, whose event loop goes round, is left as it was."""
    request_timeout_s = 3.0
    hang_s = 2 * request_timeout_s
    server = start(
        tiny_env,
        TEXEL_REQUEST_TIMEOUT_S=str(request_timeout_s),
        TEXEL_IMAGE__ENABLED="false",  # one model: a cheaper start
    )
    victim = None
    try:
        wait_whole(server)
        wait_for(lambda: readiness(server)[0] == 200, timeout=120)
        healthy, victim = sorted(http_processes(server), key=lambda p: p.name())
        name = victim.name()
        victim.suspend()  # SIGSTOP: alive, holding its socket, its event loop still
        stopped = time.monotonic()
        # Not a request meanwhile: the kernel may hand its connection to the stopped one.
        deadline = stopped + hang_s + 30
        while not gone(victim):
            assert time.monotonic() < deadline, f"{name} not killed:\n{server.log()}"
            time.sleep(0.05)
        assert time.monotonic() - stopped > hang_s - 1  # killed for its silence...
        said = rf"{name} \(pid {victim.pid}\) has shown no sign of life"
        assert re.search(said, server.log(10**7)), server.log()
        replacement = new_http_process(server, {healthy.pid, victim.pid}, timeout=120)
        assert psutil.Process(replacement).name() == name
        wait_whole(server)
        # ...while the other went on beating through those seconds, and was kept.
        assert {p.pid for p in http_processes(server)} == {healthy.pid, replacement}
        assert healthy.is_running() and healthy.name() == "texel-http-0"
        assert f"(pid {healthy.pid})" not in server.log(10**7)
        assert [r.status_code for r in recognize_many(server, 4)] == [200] * 4
        # The engine too: stopped, it answers neither the request sent to it nor the
        # launcher, and is killed and started again; the request is answered meanwhile.
        victim = engine_process(server)
        victim.suspend()
        stopped = time.monotonic()
        answer = recognize(server, timeout=hang_s + 30, text="y_3 - 7")  # none read before
        assert answer.status_code == 503 and error_code(answer) == "engine_unavailable"
        while not gone(victim):
            assert time.monotonic() < stopped + hang_s + 30, f"engine not killed:\n{server.log()}"
            time.sleep(0.05)
        said = rf"texel-engine-cpu \(pid {victim.pid}\) has shown no sign of life"
        assert re.search(said, server.log(10**7)), server.log()
        wait_for(lambda: readiness(server)[0] == 200, timeout=120)
        time.sleep(2 * FOLLOW_S)  # every HTTP process has read the new engine's state
        assert [r.status_code for r in recognize_many(server, 4)] == [200] * 4
    finally:
        if victim is not None and not gone(victim):
            victim.resume()  # SIGCONT: let it stop with the server
        server.stop()


@pytest.fixture(scope="module")
def engine_killed(restartable):
    """Kill the engine while three images wait in its queue, then read /readyz until
    the launcher's new engine is ready: the old engine's pid, what the clients got and
    how long after the kill, and every /readyz answer."""
    server = restartable.server
    wait_whole(server)
    engine = engine_process(server)
    assert engine is not None

    def post() -> tuple[httpx.Response, float]:
        response = generate(server)
        return response, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post) for _ in range(3)]
        wait_for(lambda: server.metric("texel_queue_depth", model="image") == 3)
        engine.kill()
        killed_at = time.monotonic()
        answered = [future.result() for future in futures]
    # Once the launcher has seen it die (and dropped the dead engine's metrics), before
    # the new engine has loaded anything.
    wait_for(lambda: f"(pid {engine.pid}) exited with code -9" in server.log(10**7))
    return {
        "old_pid": engine.pid,
        "responses": [response for response, _ in answered],
        "waited_s": [at - killed_at for _, at in answered],
        "metrics_while_down": httpx.get(server.url + "/metrics", timeout=10).text,
        "readiness": readiness_until_ready(server, timeout=120),
    }


def test_requests_in_a_killed_engine_get_503_engine_unavailable_at_once(engine_killed):
    for response in engine_killed["responses"]:
        assert response.status_code == 503, response.text
        assert error_code(response) == "engine_unavailable"
        assert response.headers["Retry-After"] == "1"
    assert max(engine_killed["waited_s"]) < 5


def test_readiness_and_queue_depth_read_0_while_the_engine_restarts_not_no_data(engine_killed):
    """What an alert on `texel_model_ready == 0` and an autoscaler on the queue depth
    look at: the engine's own series went with its process."""
    text = engine_killed["metrics_while_down"]
    for model in ("formula", "image"):
        assert f'texel_model_ready{{model="{model}"}} 0.0' in text, text
        assert f'texel_queue_depth{{model="{model}"}} 0.0' in text, text


def test_readyz_answers_503_while_the_engine_restarts_then_200(engine_killed):
    *restarting, (status, _) = engine_killed["readiness"]
    for status_before, body in restarting:
        assert status_before == 503 and body["ready"] is False, body
        assert set(body["models"].values()) <= {"unavailable", "loading", "ready"}, body
        assert set(body["models"].values()) != {"ready"}, body
    # The new engine takes seconds to start: meanwhile no engine is there at all.
    assert any("unavailable" in body["models"].values() for _, body in restarting)
    assert status == 200


def test_the_launcher_restarts_a_killed_engine_and_requests_succeed_again(
    restartable, engine_killed
):
    server = restartable.server
    old = engine_killed["old_pid"]
    assert f"texel-engine-cpu (pid {old}) exited with code -9" in server.log(10**7)
    new = engine_process(server)
    assert new is not None and new.pid != old
    wait_for(lambda: all(readiness(server)[0] == 200 for _ in range(4)), timeout=30)
    time.sleep(2 * FOLLOW_S)  # every HTTP process has read the engine's state since
    assert [r.status_code for r in recognize_many(server, 6)] == [200] * 6
    image = generate(server)
    assert image.status_code == 200, image.text


def test_a_killed_fork_server_takes_its_children_and_the_launcher_starts_them_all_again(
    restartable,
):
    """Children the launcher can no longer see (their fork server, which reports their
    exit, is gone) would serve beside their replacements: they end with it instead."""
    server = restartable.server
    wait_whole(server)
    launcher = psutil.Process(server.process.pid)
    fork = next(p for p in launcher.children() if p.name() == "texel-fork")
    children = fork.children()
    assert {p.name() for p in children} == {"texel-cpu", "texel-http-0", "texel-http-1"}
    fork.kill()
    wait_for(lambda: all(gone(p) for p in children), timeout=5)
    wait_whole(server)  # two HTTP processes again, from a new fork server
    assert all(p.pid not in {c.pid for c in children} for p in http_processes(server))
    wait_for(lambda: readiness(server)[0] == 200, timeout=120)
    time.sleep(2 * FOLLOW_S)  # every HTTP process has read the engine's state since
    assert [r.status_code for r in recognize_many(server, 4)] == [200] * 4


# Last: it stops the server the tests above share.
def test_sigterm_answers_every_accepted_request_then_exits_0_leaving_nothing_behind(restartable):
    """SIGTERM to the launcher, as Kubernetes sends it, and SIGINT to every other process
    as well, as Ctrl-C in a terminal sends it to the whole group: the children leave it
    to the launcher, whose SIGTERM then drains them (taken as a second signal, it had cut
    the requests in flight off with 503 at once)."""
    server = restartable.server
    wait_whole(server)
    wait_for(lambda: readiness(server)[0] == 200)
    children = psutil.Process(server.process.pid).children(recursive=True)
    # The launcher's directory: the engine's socket and the metrics of every process.
    workdir = Path(engine_process(server).environ()["PROMETHEUS_MULTIPROC_DIR"]).parent
    assert (workdir / "engine-0.sock").exists()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(generate, server) for _ in range(3)]
        wait_for(lambda: server.metric("texel_queue_depth", model="image") == 3)
        for child in children:
            child.send_signal(signal.SIGINT)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # For the grace period the processes still listen, and say they drain.
        wait_for(lambda: readiness(server)[1]["draining"], timeout=GRACE_S)
        late = generate(server)
        assert late.status_code == 503 and error_code(late) == "draining"
        assert [f.result().status_code for f in futures] == [200] * 3
    assert server.process.wait(signalled + GRACE_S + DRAIN_S - time.monotonic()) == 0
    try:
        wait_for(lambda: all(gone(child) for child in children), timeout=15)
    except AssertionError:
        left = [(c.pid, c.name(), c.status()) for c in children if not gone(c)]
        raise AssertionError(f"still running after the launcher exited: {left}") from None
    assert not workdir.exists()


def test_a_killed_launcher_leaves_no_process_behind(shared):
    """Last of the shared server's tests: SIGKILL gives the launcher no chance to stop
    anything, and its fork server, engine and HTTP processes still end by themselves."""
    processes = psutil.Process(shared.process.pid).children(recursive=True)
    assert {p.name() for p in processes} >= {"texel-fork", "texel-cpu", "texel-http-0"}
    shared.process.kill()  # not waited for yet: a zombie is gone all the same
    wait_for(lambda: all(gone(p) for p in processes), timeout=10)
