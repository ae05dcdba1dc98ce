"""bench.connection_spread counts each process's established connections to the port, and
bench.compare samples that count during a load."""

import os
import socket
import subprocess
import sys

from bench.connection_spread import held


def test_the_connections_a_process_accepted_on_the_port_are_counted_as_its_own():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    accepted = [listener.accept()[0] for _ in clients]
    try:
        # The clients' ends are on other ports; only the three accepted ends count.
        assert held(os.getpid(), port) == [3]
        accepted.pop().close()
        assert held(os.getpid(), port) == [2]
    finally:
        for sock in [*clients, *accepted, listener]:
            sock.close()


def test_bench_compare_samples_the_spread_while_its_load_runs():
    from bench.compare import spread_later

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    spread = spread_later(os.getpid(), f"http://127.0.0.1:{port}", 0.2)
    assert not spread.done()  # sampled later, while the load runs, not at once
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    accepted = [listener.accept()[0] for _ in clients]
    try:
        assert spread.result(timeout=5) == [2]
    finally:
        for sock in [*clients, *accepted, listener]:
            sock.close()


def test_bench_compare_samples_the_cores_each_http_process_uses_during_the_load():
    from bench.compare import cores_later

    # A server of one process and no children: it listens on a port and keeps a core busy.
    busy = (
        "import socket, sys, time\n"
        "listener = socket.create_server(('127.0.0.1', 0))\n"
        "print(listener.getsockname()[1], flush=True)\n"
        "deadline = time.monotonic() + 1.5\n"
        "while time.monotonic() < deadline: pass\n"
    )
    server = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        sampled = cores_later(server.pid, f"http://127.0.0.1:{port}", 0.1, 0.8).result(timeout=5)
    finally:
        server.kill()
        server.wait()
    assert len(sampled["cores_per_http_process"]) == 1
    assert sampled["cores_per_http_process"][0] > 0.25  # a core, or its share of a busy one
    assert sampled["engine_cores"] == 0
