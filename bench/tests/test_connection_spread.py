"""bench.connection_spread counts each process's established connections to the port."""

import os
import socket

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
