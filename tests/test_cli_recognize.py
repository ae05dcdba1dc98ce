"""`texel recognize PATH...`: a folder of formula images to JSON lines, through a real
server on a socket or the formula model in the command's own process, resumable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.recognize_cli import append_lines, done_paths, run
from tests.conftest import ROOT, formula_png, free_port

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


def texel_recognize(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "recognize", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_name(records: list[dict], root: Path) -> dict[str, dict]:
    return {Path(r["path"]).relative_to(root).as_posix(): r for r in records}


def answers(out: Path, root: Path) -> dict[str, str]:
    """Per image, its LaTeX or its error code."""
    return {
        name: record["latex"] if "latex" in record else record["error"]["code"]
        for name, record in by_name(lines(out), root).items()
    }


def test_through_a_server_every_image_has_a_line_and_the_broken_one_its_error(
    server, folder, tmp_path
):
    out = tmp_path / "results.jsonl"
    done = texel_recognize(str(folder), "--out", str(out), "--url", server.url)
    assert done.returncode == 1, done.stderr  # some image failed
    records = by_name(lines(out), folder)
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
    assert run([str(folder)], out=str(out), url=server.url, progress=False) == 0
    assert out.read_text().startswith(before)  # nothing written before is touched
    added = lines(out)[len(GOOD) + 1 :]
    assert [Path(r["path"]).name for r in added] == ["d.png"]
    assert "latex" in added[0]
    assert "4 images already in" in capsys.readouterr().err


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
