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
def dropping_server() -> Iterator[str]:
    """A server that answers `/livez` as Texel does and resets the connection of every
    POST: an error whose text is empty on the client's side."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            # Linger 0: closing sends a reset, not an orderly end.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_an_error_line_names_what_went_wrong_when_the_error_has_no_text(
    dropping_server, folder, tmp_path
):
    out = tmp_path / "results.jsonl"
    assert run([str(folder / "a.png")], out=str(out), url=dropping_server, progress=False) == 1
    [record] = lines(out)
    assert record["error"]["code"] == "unreachable"
    said = record["error"]["message"].removeprefix(f"{dropping_server}:").strip()
    assert said, record  # the exception's type name, such as ReadError


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
