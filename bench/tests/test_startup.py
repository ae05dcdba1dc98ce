"""bench.startup measures a real server's start: when it answered, and each process's
CPU and memory once ready."""

from bench.startup import measure


def test_startup_reports_when_the_server_answered_and_what_its_processes_cost(tiny_env):
    result = measure({**tiny_env, "TEXEL_HTTP_PROCESSES": "1"})  # one process on a CPU
    assert 0 < result["live_s"] <= result["ready_s"]
    launcher = result["processes"]["launcher"]
    assert launcher["cpu_s"] > 0 and launcher["rss_mb"] >= launcher["pss_mb"] > 0
