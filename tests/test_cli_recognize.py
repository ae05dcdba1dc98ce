"""`texel recognize PATH...`: a folder of formula images to JSON lines, through a real
server on a socket or the formula model in the command's own process, resumable."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app import recognize_cli
from app.recognize_cli import append_lines, done_paths, run
from tests.conftest import ROOT, formula_png, free_port, wait_for

GOOD = {"a.png": "x^2 + 1", "b.png": "a + b = c", "sub/c.jpg": "y = 2x"}


@pytest.fixture
def folder(tmp_path) -> Path:
    """Three good formula pictures (one a JPEG in a subfolder), a broken PNG and a text
    file that is not an image."""
    images = tmp_path / "images"
    for name, text in GOOD.items():
        path = images / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(formula_png(text, fmt="JPEG" if name.endswith(".jpg") else "PNG"))
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but nothing of a picture follows")
    (images / "notes.txt").write_text("not an image")
    return images


def texel_recognize(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "recognize", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_name(out: Path, root: Path) -> dict[str, dict]:
    """The lines of `out` by their image's path under `root`; a line's path is read from
    the output file's folder."""
    return {(out.parent / r["path"]).relative_to(root).as_posix(): r for r in lines(out)}


def answers(out: Path, root: Path) -> dict[str, str]:
    """Per image, its LaTeX or its error code."""
    return {
        name: record["latex"] if "latex" in record else record["error"]["code"]
        for name, record in by_name(out, root).items()
    }


def test_through_a_server_every_image_has_a_line_and_the_broken_one_its_error(
    server, folder, tmp_path
):
    out = tmp_path / "results.jsonl"
    done = texel_recognize(str(folder), "--out", str(out), "--url", server.url)
    assert done.returncode == 1, done.stderr  # some image failed
    assert "passed over 1 file(s) of the folders that are not" in done.stderr
    assert f"(such as {folder / 'notes.txt'})" in done.stderr
    records = by_name(out, folder)
    assert set(records) == {*GOOD, "broken.png"}
    for name in GOOD:
        assert isinstance(records[name]["latex"], str), records[name]
        assert isinstance(records[name]["latex_compact"], str)
    assert records["broken.png"]["error"]["code"] in {"unsupported_image", "corrupt_image"}
    assert "latex" not in records["broken.png"]


def test_in_process_answers_what_the_server_answers(server, tiny_env, folder, tmp_path):
    """No --url: the formula model opens in the command's own process, with the same
    stages as a server, so the LaTeX and the error codes are the server's."""
    served, local = tmp_path / "served.jsonl", tmp_path / "local.jsonl"
    run([str(folder)], out=str(served), url=server.url, progress=False)
    done = texel_recognize(str(folder), "--out", str(local), env=tiny_env)
    assert done.returncode == 1, done.stderr
    assert answers(local, folder) == answers(served, folder)


def write_lines(out: Path, records: list[dict]) -> str:
    text = "".join(json.dumps(record) + "\n" for record in records)
    out.write_text(text)
    return text


def test_a_second_run_sends_only_the_images_not_yet_in_the_output(server, folder, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    before = write_lines(
        out,
        [{"path": str(folder / name), "latex": "from the first run"} for name in GOOD]
        + [{"path": str(folder / "broken.png"), "error": {"code": "unsupported_image"}}],
    )
    (folder / "d.png").write_bytes(formula_png("z - 1"))
    # 1: the file still holds an image that failed, and the run says how to send it again.
    assert run([str(folder)], out=str(out), url=server.url, progress=False) == 1
    assert out.read_text().startswith(before)  # nothing written before is touched
    added = lines(out)[len(GOOD) + 1 :]
    assert [Path(r["path"]).name for r in added] == ["d.png"]
    assert "latex" in added[0]
    said = capsys.readouterr().err
    assert "4 images already in" in said
    assert "1 of them failed (--retry-failed sends those again)" in said


def test_retry_failed_sends_again_the_images_whose_line_is_an_error(server, folder, tmp_path):
    out = tmp_path / "results.jsonl"
    write_lines(
        out,
        [{"path": str(folder / name), "latex": "from the first run"} for name in GOOD]
        + [{"path": str(folder / "broken.png"), "error": {"code": "unsupported_image"}}],
    )
    (folder / "broken.png").write_bytes(formula_png("fixed"))
    assert run([str(folder)], out=str(out), url=server.url, retry_failed=True, progress=False) == 0
    added = lines(out)[len(GOOD) + 1 :]
    assert [Path(r["path"]).name for r in added] == ["broken.png"]
    assert "latex" in added[0]
    every_image = {(folder / name).resolve() for name in [*GOOD, "broken.png"]}
    assert done_paths(out, retry_failed=True) == every_image


def test_a_line_cut_short_by_an_interruption_is_not_counted_and_is_ended(tmp_path):
    out = tmp_path / "results.jsonl"
    whole = json.dumps({"path": str(tmp_path / "a.png"), "latex": "x"})
    out.write_text(whole + "\n" + '{"path": "' + str(tmp_path / "b.png") + '", "lat')
    assert done_paths(out) == {(tmp_path / "a.png").resolve()}
    with append_lines(out) as sink:
        sink.write(json.dumps({"path": str(tmp_path / "b.png"), "latex": "y"}) + "\n")
    assert done_paths(out) == {(tmp_path / "a.png").resolve(), (tmp_path / "b.png").resolve()}


def test_a_last_line_cut_inside_a_character_is_not_counted_and_the_file_is_resumed(tmp_path):
    out = tmp_path / "results.jsonl"
    whole = json.dumps({"path": "a.png", "latex": "x"}) + "\n"
    cut = json.dumps({"path": "日本.png", "latex": "y"}, ensure_ascii=False).encode()[:12]
    out.write_bytes(whole.encode() + cut)
    assert done_paths(out) == {(tmp_path / "a.png").resolve()}
    with append_lines(out) as sink:
        sink.write(json.dumps({"path": "b.png", "latex": "z"}) + "\n")
    assert done_paths(out) == {(tmp_path / "a.png").resolve(), (tmp_path / "b.png").resolve()}


def test_a_file_name_that_is_not_utf8_has_a_json_line_that_names_it_for_the_next_run(
    server, tmp_path, capsys
):
    images = tmp_path / "images"
    images.mkdir()
    name = os.fsdecode(b"caf\xe9.png")  # Latin-1, as an old archive's names are
    (images / name).write_bytes(formula_png())
    out = tmp_path / "results.jsonl"
    assert run([str(images)], out=str(out), url=server.url, progress=False) == 0
    [record] = [json.loads(line) for line in out.read_bytes().decode("utf-8").splitlines()]
    assert (out.parent / record["path"]).resolve() == (images / name).resolve()
    assert "latex" in record
    assert run([str(images)], out=str(out), url=server.url, progress=False) == 0
    assert "1 images already in" in capsys.readouterr().err


def test_a_reader_that_leaves_early_ends_the_run_without_a_traceback(server, folder):
    """As `texel recognize images/ | head -1` does."""
    command = [str(folder), "--url", server.url, "--concurrency", "1"]
    running = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "recognize", *command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    running.stdout.close()  # gone before the first line
    _, err = running.communicate(timeout=60)
    assert running.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_server_that_cannot_be_reached_stops_the_run_before_any_line(folder, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    unreachable = f"http://127.0.0.1:{free_port()}"
    assert run([str(folder)], out=str(out), url=unreachable, progress=False) == 2
    assert "could not reach" in capsys.readouterr().err
    assert not out.exists()


def test_a_url_that_is_not_a_servers_base_url_stops_the_run_saying_what_answered(
    server, folder, tmp_path, capsys
):
    out = tmp_path / "results.jsonl"
    route = server.url + "/recognize"  # the route appended: a natural mistake
    assert run([str(folder)], out=str(out), url=route, progress=False) == 2
    err = capsys.readouterr().err
    assert f"GET {route}/livez answered 404 Not Found" in err
    assert f"base URL, perhaps {server.url}" in err
    assert not out.exists()


@pytest.fixture
def scripted_server() -> Iterator:
    """A server on a socket that answers `/livez` and `/v1/models` as Texel does, and the
    POSTs with the answers given in turn, the last again once they run out: "ok" (LaTeX),
    "reset" (the connection reset: an error with no text on the client's side), or a
    status with Texel's error body and `Retry-After: 0`. Its `posts` counts the POSTs; its
    `state` is the formula model's, and while it is not "ready" POSTs are answered 503
    `not_ready`, as Texel answers them."""
    started = []

    def start(*script: str | tuple[int, str]) -> ThreadingHTTPServer:
        answers = list(script)

        class Handler(BaseHTTPRequestHandler):
            def answer(self, status: int, body: dict, retry: bool = False) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if retry:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - the stdlib's name
                card = {
                    "task": "formula_recognition",
                    "state": httpd.state,
                    "limits": {"max_upload_bytes": 1 << 20},
                }
                models = {"object": "list", "data": [card]}
                self.answer(200, {"status": "ok"} if self.path == "/livez" else models)

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                httpd.posts += 1
                if httpd.state != "ready":
                    self.answer(503, {"error": {"code": "not_ready", "message": "loading"}}, True)
                    return
                now = answers.pop(0) if len(answers) > 1 else answers[0]
                if now == "ok":
                    self.answer(200, {"latex": "x", "latex_compact": "x", "confidence": 1.0})
                elif now == "page":  # a proxy's page in front of the server
                    self.answer(200, {"html": "<p>Sign in to this network</p>"})
                elif now == "reset":  # linger 0: closing sends a reset, not an orderly end
                    linger = struct.pack("ii", 1, 0)
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                    self.connection.close()
                else:
                    status, code = now
                    self.answer(status, {"error": {"code": code, "message": f"said {code}"}}, True)

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.posts = 0
        httpd.state = "ready"
        httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return httpd

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def quick_retries(monkeypatch) -> None:
    monkeypatch.setattr(recognize_cli, "FIRST_RETRY_WAIT_S", 0.01)


def test_an_answer_that_comes_when_the_image_is_sent_again_is_written(
    scripted_server, quick_retries, folder, tmp_path
):
    httpd = scripted_server("reset", (503, "unavailable"), "ok")
    out = tmp_path / "results.jsonl"
    assert run([str(folder / "a.png")], out=str(out), url=httpd.url, progress=False) == 0
    assert [r["latex"] for r in lines(out)] == ["x"]
    assert httpd.posts == 3


def test_a_model_still_loading_is_waited_for_before_the_first_image_is_sent(
    scripted_server, quick_retries, monkeypatch, folder, tmp_path, capsys
):
    """A server just started (`make run`, then `texel recognize` at once) answers
    `not_ready` until its model has loaded: the run waits for it rather than spend its
    retries and stop."""
    monkeypatch.setattr(recognize_cli, "LOADING_POLL_S", 0.05)
    httpd = scripted_server("ok")
    httpd.state = "loading"
    threading.Timer(1.0, setattr, (httpd, "state", "ready")).start()
    out = tmp_path / "results.jsonl"
    assert run([str(folder / "a.png")], out=str(out), url=httpd.url, progress=False) == 0
    assert [r["latex"] for r in lines(out)] == ["x"] and httpd.posts == 1
    assert "waiting for" in capsys.readouterr().err


def test_a_model_that_failed_to_load_stops_the_run_before_any_image(
    scripted_server, folder, tmp_path, capsys
):
    httpd = scripted_server("ok")
    httpd.state = "failed"
    out = tmp_path / "results.jsonl"
    assert run([str(folder / "a.png")], out=str(out), url=httpd.url, progress=False) == 2
    assert httpd.posts == 0 and not out.exists()
    assert "formula model failed to load" in capsys.readouterr().err


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("reset", None),  # an error with no text of its own still says what it was
        ((503, "draining"), "said draining"),
        ((429, "queue_full"), "said queue_full"),
        ((502, "bad_gateway"), "said bad_gateway"),
    ],
)
def test_a_server_at_fault_through_the_retries_stops_the_run_with_no_line_for_the_image(
    answer, expected, scripted_server, quick_retries, folder, tmp_path, capsys
):
    """An image's line says what the image gave; were the server's faults written as its
    lines, a run after a restart would skip every image that met the server down."""
    httpd = scripted_server(answer)
    out = tmp_path / "results.jsonl"
    assert run([str(folder / "a.png")], out=str(out), url=httpd.url, progress=False) == 2
    assert out.read_text() == ""
    assert httpd.posts == recognize_cli.RETRIES + 1
    last = capsys.readouterr().err.splitlines()[-1]
    prefix = f"texel recognize: stopped, {httpd.url}: "
    suffix = f"; 0 of 1 images written to {out}; run the same command again to resume"
    assert last.startswith(prefix) and last.endswith(suffix), last
    said = last[len(prefix) : -len(suffix)]
    assert said == expected if expected else said, last


def test_a_link_to_nothing_in_a_folder_has_its_error_line(scripted_server, folder, tmp_path):
    """It was passed over in silence, neither read nor said to be unreadable."""
    (folder / "gone.png").symlink_to(tmp_path / "moved-away.png")
    httpd = scripted_server("ok")
    out = tmp_path / "results.jsonl"
    assert run([str(folder)], out=str(out), url=httpd.url, progress=False) == 1
    gone = [r for r in lines(out) if r["path"].endswith("moved-away.png")]  # by its target
    assert [r["error"]["code"] for r in gone] == ["unreadable"]
    assert "No such file or directory" in gone[0]["error"]["message"]


def test_a_page_answered_200_in_the_servers_place_stops_the_run_with_no_line(
    scripted_server, folder, tmp_path, capsys
):
    """A proxy's page (a captive portal, a login) is no answer for the image: it was a
    traceback, and the rest of the run lost."""
    httpd = scripted_server("page")
    out = tmp_path / "results.jsonl"
    assert run([str(folder / "a.png")], out=str(out), url=httpd.url, progress=False) == 2
    assert out.read_text() == "" and httpd.posts == 1
    assert "answered 200 without Texel's answer (200 OK: " in capsys.readouterr().err


def test_a_server_lost_mid_run_leaves_the_lines_written_and_the_same_command_resumes(
    scripted_server, quick_retries, server, folder, tmp_path, capsys
):
    httpd = scripted_server("ok", "ok", "reset")  # the server dies after two images
    out = tmp_path / "results.jsonl"
    images = [str(folder / name) for name in GOOD]
    assert run(images, out=str(out), url=httpd.url, concurrency=1, progress=False) == 2
    assert len(lines(out)) == 2
    assert "2 of 3 images written" in capsys.readouterr().err
    assert run(images, out=str(out), url=server.url, progress=False) == 0
    assert sorted(by_name(out, folder)) == sorted(GOOD)
    assert all("latex" in record for record in lines(out))


def test_an_image_over_the_servers_upload_limit_has_its_error_line_and_is_not_sent(
    server, folder, tmp_path
):
    """A server cuts short an upload far over its limit: the client would see a reset
    connection, not the image's fault. Sparse, so that it takes no disk."""
    huge = folder / "huge.png"
    with huge.open("wb") as file:
        file.truncate(4 << 20)
    out = tmp_path / "results.jsonl"
    assert run([str(huge), str(folder / "a.png")], out=str(out), url=server.url) == 1
    records = by_name(out, folder)
    assert records["huge.png"]["error"] == {
        "code": "image_too_large",
        "message": f"the image exceeds {256 * 1024} bytes",  # as the server words it
    }
    assert "latex" in records["a.png"]


@pytest.mark.parametrize("concurrency", ["0", "-3"])
def test_a_concurrency_below_one_is_refused_before_any_work(concurrency, server, folder, tmp_path):
    out = tmp_path / "results.jsonl"
    given = ["--out", str(out), "--url", server.url, "--concurrency", concurrency]
    done = texel_recognize(str(folder), *given, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--concurrency" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "out, problem", [("missing/results.jsonl", "there is no folder"), ("images", "is a folder")]
)
def test_an_output_file_that_cannot_be_written_stops_the_run_before_any_work(
    out, problem, server, folder, tmp_path, capsys
):
    """A typo in a folder name is an error, not a new folder: the next run of the same
    command should find the lines of this one."""
    assert run([str(folder)], out=str(tmp_path / out), url=server.url, progress=False) == 2
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    assert not list(folder.glob("*.jsonl"))


def test_the_same_job_from_another_working_directory_resumes_the_same_output(
    server, folder, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "results.jsonl"
    monkeypatch.chdir(tmp_path)
    assert run(["images"], out="results.jsonl", url=server.url, progress=False) == 1
    written = out.read_text()
    paths = {"images/a.png", "images/b.png", "images/sub/c.jpg", "images/broken.png"}
    assert {r["path"] for r in lines(out)} == paths  # relative to the output file's folder
    monkeypatch.chdir(tmp_path.parent)
    job = tmp_path.name
    assert run([f"{job}/images"], out=f"{job}/results.jsonl", url=server.url, progress=False) == 1
    assert out.read_text() == written
    assert "4 images already in" in capsys.readouterr().err


def test_a_line_names_an_image_outside_the_output_files_folder_by_its_absolute_path(
    server, folder, tmp_path, monkeypatch
):
    (tmp_path / "results").mkdir()
    out = tmp_path / "results" / "run.jsonl"
    monkeypatch.chdir(tmp_path)
    run(["images/a.png"], out="results/run.jsonl", url=server.url, progress=False)
    assert [r["path"] for r in lines(out)] == [str(folder / "a.png")]


def test_ctrl_c_stops_with_a_line_that_says_how_many_were_written_and_how_to_resume(
    server, tmp_path
):
    images = tmp_path / "many"
    images.mkdir()
    for i in range(40):  # each picture its own, so none is answered from the server's cache
        (images / f"{i:02d}.png").write_bytes(formula_png(f"x + {i}"))
    out = tmp_path / "results.jsonl"
    command = [str(images), "--out", str(out), "--url", server.url, "--concurrency", "1"]
    running = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "recognize", *command],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        # As in a terminal, even where this runner was started with SIGINT ignored (a
        # background job of a shell), which the child would inherit.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for(lambda: out.exists() and out.stat().st_size > 0)
    running.send_signal(signal.SIGINT)
    _, err = running.communicate(timeout=60)
    assert running.returncode == 130, err
    written = len(lines(out))  # every line whole
    assert 0 < written < 40
    assert err.splitlines()[-1] == (
        f"texel recognize: interrupted, {written} of 40 images written to {out}; "
        "run the same command again to resume"
    )
    assert "Traceback" not in err
    assert texel_recognize(*command).returncode == 0
    assert sorted(Path(r["path"]).name for r in lines(out)) == sorted(os.listdir(images))


def test_an_output_file_that_is_not_json_lines_is_refused_and_left_as_it_was(folder, tmp_path):
    """`--out` naming a picture by mistake: its bytes are no text to read lines from."""
    victim = tmp_path / "victim.png"
    victim.write_bytes(formula_png())
    before = victim.read_bytes()
    unreachable = f"http://127.0.0.1:{free_port()}"  # refused before any image is sent
    done = texel_recognize(str(folder), "--out", str(victim), "--url", unreachable)
    assert (done.returncode, done.stderr.splitlines()) == (
        2,
        [f"texel recognize: --out {victim} is not a JSON lines file"],
    )
    assert victim.read_bytes() == before


def test_an_empty_url_is_refused_rather_than_taken_for_no_url(folder, tmp_path):
    """An unset variable in `--url "$SERVER"` would otherwise run the model in this
    process, with none of the checks that it makes without --url."""
    env = {"TEXEL_FORMULA__MODEL": "/nonexistent/model"}
    done = texel_recognize(str(folder / "a.png"), "--url", "", env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        "texel recognize: --url is empty; leave it out to run the model in this process"
    ]
