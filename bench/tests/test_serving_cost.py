"""bench.serving_cost tells the HTTP processes from the rest by the port they listen on."""

import os
import socket

from bench.serving_cost import cpu_by_role


def test_a_process_listening_on_the_port_counts_as_http():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        roles = cpu_by_role(os.getpid(), port)
        assert roles["http"] > 0
        assert roles["launcher"] == 0

    elsewhere = cpu_by_role(os.getpid(), port)  # nothing listens there now
    assert elsewhere["http"] == 0
    assert elsewhere["launcher"] > 0
