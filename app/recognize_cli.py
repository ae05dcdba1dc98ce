"""`texel recognize`: every formula image in some files and folders to LaTeX, one JSON
line per image.

The images go through a running server (`--url`) or, without one, through an engine in
this process with the formula model only: `LocalEngine` behind the same `Runtime` that a
one-process server answers with, so an image gives the same LaTeX, or the same error
code, either way. Lines already in the output file are skipped, so a run that was
interrupted picks up where it stopped. A line names its image relative to the output
file's folder when the image is under it, else by its absolute path, so the same command
resumes from any working directory.

A line says what the image gave, LaTeX or an error of the image's own. When the server,
not the image, is at fault (it cannot be reached, is draining, overloaded or refuses
the key) and stays so through the retries, the run stops without a line for the images
not answered, so that the same command sends them again.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import httpx

# What a folder is searched for; a file named on the command line is sent whatever its name.
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"})
RETRIES = 5  # a server at fault (see `TRY_AGAIN`) is tried again this often per image
FIRST_RETRY_WAIT_S = 1.0  # doubled at each retry, unless the answer says `Retry-After`
LONGEST_RETRY_WAIT_S = 30.0
# Statuses that speak of the server, not of the image: tried again, then the run stops.
# 502: a proxy in front of a server that is restarting.
TRY_AGAIN = frozenset({429, 502, 503})
# Statuses that no retry changes and that would be the same for every image.
GIVE_UP = frozenset({401, 403, 404})
# A model in these states (`GET /v1/models`) is waited for before the first image is sent,
# this long at the most, looking again at this interval.
STARTING = frozenset({"loading", "unavailable"})
LOADING_WAIT_S = 600.0
LOADING_POLL_S = 1.0


class RecognizeError(Exception):
    """Why a whole run cannot go on: no images, no server, no model."""


class ServerLost(RecognizeError):
    """The server stopped answering for the images (see `TRY_AGAIN`, `GIVE_UP`) in the
    middle of a run."""


def find_images(paths: Iterable[str | Path], passed_over: list[Path] | None = None) -> list[Path]:
    """The files named, and the images under the folders named (recursively), in order
    and each once; the other files of those folders go to `passed_over`. A link to
    nothing counts as a file, so that its line says it could not be read."""
    found: dict[Path, Path] = {}
    for given in map(Path, paths):
        if given.is_dir():
            files = sorted(p for p in given.rglob("*") if p.is_file() or _dangling(p))
            candidates = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
            if passed_over is not None:
                passed_over += [p for p in files if p.suffix.lower() not in IMAGE_SUFFIXES]
        elif given.exists():
            candidates = [given]
        else:
            raise RecognizeError(f"{given}: no such file or folder")
        for path in candidates:
            found.setdefault(path.resolve(), path)
    return list(found.values())


def _dangling(path: Path) -> bool:
    return path.is_symlink() and not path.exists()


def line_path(image: Path, folder: Path | None) -> str:
    """How a line names `image`: relative to `folder` (the output file's, resolved) when
    the image is under it, else absolute; as given when there is no output file."""
    if folder is None:
        return str(image)
    try:
        return str(image.resolve().relative_to(folder))
    except ValueError:
        return str(image.resolve())


def last_lines(out: Path) -> dict[Path, bool]:
    """Each image with a line in `out` (its path read from `out`'s folder), and whether
    its last line, the one that counts, holds LaTeX. A line cut short by an interruption,
    even inside a character, is not counted. UnicodeDecodeError: `out` is not text (such
    as a picture): some line is not UTF-8 and none is a line of this command's."""
    last: dict[Path, bool] = {}
    if not out.exists():
        return last
    not_text = None  # a line cut inside a character, or `out` is a picture
    with out.open("rb") as lines:
        for line in lines:
            try:
                record = json.loads(line.decode("utf-8"))
                last[(out.parent / record["path"]).resolve()] = "latex" in record
            except UnicodeDecodeError as exc:
                not_text = exc
            except (ValueError, KeyError, TypeError):
                continue
    if not_text is not None and not last:
        raise not_text
    return last


def done_paths(out: Path, retry_failed: bool = False) -> set[Path]:
    """The images that already have a line in `out`; with `retry_failed`, only those
    whose last line holds LaTeX."""
    return {path for path, ok in last_lines(out).items() if ok or not retry_failed}


def append_lines(out: Path) -> TextIO:
    """`out` opened to add lines, after ending a last line an interruption cut short."""
    cut = False
    if out.exists() and out.stat().st_size:
        with out.open("rb") as existing:
            existing.seek(-1, 2)
            cut = existing.read(1) != b"\n"
    sink = out.open("a", encoding="utf-8")
    if cut:
        sink.write("\n")
    return sink


def json_line(record: dict[str, Any]) -> str:
    """`record` as a line of JSON. A file name that is not UTF-8 reaches Python with its
    bytes as lone surrogates, which no UTF-8 text may hold: they are written escaped
    (`\\udce9`), which JSON reads back as the same name."""
    text = json.dumps(record, ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace").decode("utf-8") + "\n"


def read_image(path: Path, limit: int | None) -> bytes:
    """The bytes of `path`, or with a `limit` no more than one byte past it: enough to
    tell that the image is too large without holding a huge file in memory."""
    with path.open("rb") as file:
        return file.read() if limit is None else file.read(limit + 1)


def error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def too_large(data: bytes, limit: int | None) -> dict[str, Any] | None:
    """The error of an image over the server's upload limit, as the server words it."""
    if limit is not None and len(data) > limit:
        return error("image_too_large", f"the image exceeds {limit} bytes")
    return None


def reason(exc: BaseException) -> str:
    """What went wrong, never empty: some errors, such as a connection reset, carry no text."""
    return str(exc) or type(exc).__name__


def is_texel_livez(response: httpx.Response) -> bool:
    """Whether an answer to `GET /livez` is a Texel server's."""
    try:
        return response.status_code == 200 and response.json() == {"status": "ok"}
    except ValueError:
        return False


def summary(response: httpx.Response) -> str:
    """An HTTP answer in one line: its status and the start of its body."""
    status = f"{response.status_code} {response.reason_phrase}"
    body = " ".join(response.text.split())[:100]
    return f"{status}: {body}" if body else status


def error_of(response: httpx.Response) -> dict[str, Any] | None:
    """The `{"error": {"code", "message"}}` of a Texel error answer, if it is one."""
    try:
        body = response.json()
    except ValueError:
        return None
    failure = body.get("error") if isinstance(body, dict) else None
    if isinstance(failure, dict) and {"code", "message"} <= failure.keys():
        return error(failure["code"], failure["message"])
    return None


def said(response: httpx.Response) -> str:
    """What an answer says went wrong: a Texel error's message, else its `summary`."""
    failure = error_of(response)
    return failure["error"]["message"] if failure else summary(response)


def formula_card(response: httpx.Response) -> dict[str, Any] | None:
    """The formula model's card in an answer to `GET /v1/models`, if it has one."""
    try:
        cards = response.json()["data"]
        [card] = [card for card in cards if card.get("task") == "formula_recognition"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return card if isinstance(card, dict) else None


def upload_limit(card: dict[str, Any] | None) -> int | None:
    """A model card's `max_upload_bytes`, if it states one."""
    try:
        limit = card["limits"]["max_upload_bytes"]
    except (KeyError, TypeError):
        return None
    return limit if isinstance(limit, int) else None


class Recognizer(ABC):
    """Where the images go: `recognize` answers `{"latex", "latex_compact", "confidence"}` or
    `{"error": {"code", "message"}}`, never raises for a fault of the image's own."""

    concurrency: int
    max_bytes: int | None = None  # an image's largest size, where known; past it, an error

    async def __aenter__(self) -> Recognizer:
        return self

    async def __aexit__(self, *exc_info) -> None:
        return None

    @abstractmethod
    async def recognize(self, data: bytes) -> dict[str, Any]: ...


class ServerRecognizer(Recognizer):
    """A running Texel server's `POST /recognize`. Raises `ServerLost` when the server,
    not the image, is at fault and stays so through `RETRIES` retries."""

    def __init__(self, url: str, api_key: str | None, concurrency: int) -> None:
        self.url = url.rstrip("/")
        self.concurrency = concurrency
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = None

    async def __aenter__(self) -> ServerRecognizer:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency)
        self._client = httpx.AsyncClient(headers=self._headers, timeout=120, limits=limits)
        try:
            await self._check()
        except BaseException:
            await self._client.aclose()
            raise
        return self

    async def _get(self, path: str) -> httpx.Response:
        import httpx

        try:
            return await self._client.get(self.url + path)
        except httpx.HTTPError as exc:
            raise RecognizeError(f"could not reach {self.url}: {reason(exc)}") from None

    async def _check(self) -> None:
        """Before any image: that a Texel server answers at `url`, takes the key, and
        serves a formula model that has loaded (waited for while it loads)."""
        response = await self._get("/livez")
        if not is_texel_livez(response):
            base = urlsplit(self.url)._replace(path="", query="", fragment="").geturl()
            raise RecognizeError(
                f"{self.url} does not answer like a Texel server: GET {self.url}/livez "
                f"answered {summary(response)}; give --url the server's base URL"
                + (f", perhaps {base}" if base != self.url else "")
            )
        # A guarded route: a missing or wrong key stops here, not once per image.
        keyed = await self._get("/v1/models")
        if keyed.status_code == 401:
            raise RecognizeError(
                f"{self.url} "
                + ("refused the API key" if self._headers else "wants an API key")
                + ": set TEXEL_API_KEY (or pass --api-key)"
            )
        card = formula_card(keyed) if keyed.status_code == 200 else None
        if card is not None and card.get("state") in STARTING:
            card = await self._wait_while_loading(card)
        if card is not None and card.get("state") == "failed":
            raise RecognizeError(f"{self.url}: its formula model failed to load")
        # Larger files are answered here, unread: a server cuts such an upload short.
        self.max_bytes = upload_limit(card)

    async def _wait_while_loading(self, card: dict[str, Any]) -> dict[str, Any] | None:
        """The formula model's card once it is no longer loading (a server just started:
        its requests would be refused `not_ready` until then), waiting `LOADING_WAIT_S` at
        the most."""
        print(f"texel recognize: waiting for {self.url} to load its formula model", file=sys.stderr)
        deadline = time.monotonic() + LOADING_WAIT_S
        while card is not None and card.get("state") in STARTING:
            if time.monotonic() > deadline:
                raise RecognizeError(
                    f"{self.url}: its formula model is still {card['state']} after "
                    f"{LOADING_WAIT_S:.0f} s"
                )
            await asyncio.sleep(LOADING_POLL_S)
            response = await self._get("/v1/models")
            card = formula_card(response) if response.status_code == 200 else None
        return card

    async def __aexit__(self, *exc_info) -> None:
        await self._client.aclose()

    async def recognize(self, data: bytes) -> dict[str, Any]:
        import httpx

        if failure := too_large(data, self.max_bytes):
            return failure
        wait = FIRST_RETRY_WAIT_S
        for attempt in range(RETRIES + 1):
            try:
                response = await self._client.post(
                    self.url + "/recognize", files={"image": ("image", data)}
                )
            except httpx.HTTPError as exc:
                problem, retry_after = reason(exc), ""
            else:
                if response.status_code not in TRY_AGAIN:
                    break
                problem = said(response)
                retry_after = response.headers.get("retry-after", "")
            if attempt == RETRIES:
                raise ServerLost(f"{self.url}: {problem}")
            seconds = float(retry_after) if retry_after.isdigit() else wait
            await asyncio.sleep(min(seconds, LONGEST_RETRY_WAIT_S))
            wait *= 2
        if response.status_code == 200:
            try:
                body = response.json()
                return {
                    "latex": body["latex"],
                    "latex_compact": body["latex_compact"],
                    "confidence": body.get("confidence"),
                }
            except (ValueError, KeyError, TypeError):  # a proxy's page, say: not the image's
                raise ServerLost(
                    f"{self.url}: answered 200 without Texel's answer ({summary(response)})"
                ) from None
        if response.status_code in GIVE_UP:
            raise ServerLost(f"{self.url}: {said(response)}")
        return error_of(response) or error("http_error", f"{self.url} answered {summary(response)}")


class LocalRecognizer(Recognizer):
    """The formula model in this process: an `Engine` behind a `LocalEngine`, on the first
    device of the settings' process plan, with the other models disabled."""

    def __init__(self, settings=None, concurrency: int | None = None) -> None:
        from app.settings import Settings

        settings = settings or Settings()
        if "formula" not in settings.models():
            raise RecognizeError("the formula model is disabled (TEXEL_FORMULA__ENABLED)")
        self.settings = settings.alone("formula")
        self.concurrency = concurrency  # unset: the formula model's batch size, once placed
        self.max_bytes = self.settings.max_upload_bytes
        self.runtime = None

    async def __aenter__(self) -> LocalRecognizer:
        from app.launcher import model_plans, request_models
        from app.serving import Runtime
        from engine import Engine, LocalEngine
        from models.devices import resolve_devices

        devices = resolve_devices(self.settings.device)[:1]
        self.concurrency = self.concurrency or self.settings.formula.batch_size(devices)
        plans = model_plans(self.settings, devices)
        engine = LocalEngine(Engine(devices[0], plans, self.settings.advanced.gpu_sharing))
        self.runtime = Runtime(self.settings, request_models(self.settings, devices), [engine])
        await self.runtime.start()
        while (state := self.runtime.model_state("formula"))[0] != "ready":
            if state[0] == "failed":
                await self.runtime.close()
                raise RecognizeError(f"the formula model failed to load: {state[1]}")
            await asyncio.sleep(0.05)
            await self.runtime.refresh()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.runtime.drain()
        await self.runtime.close()

    async def recognize(self, data: bytes) -> dict[str, Any]:
        from app.errors import to_api_error
        from telemetry import RequestTrace

        if not data:
            return error("malformed_request", "the image is empty")
        if failure := too_large(data, self.max_bytes):
            return failure
        try:
            model = self.runtime.model("formula")
            trace = RequestTrace(model.name, model.operation)
            recognized, _ = await self.runtime.serve("formula", data, trace)
        except Exception as exc:
            failure = to_api_error(exc)
            return error(failure.code, failure.message)
        return {
            "latex": recognized.latex,
            "latex_compact": recognized.compact,
            "confidence": recognized.confidence,
        }


@dataclass
class Tally:
    """The lines a run has written, and how many of them are errors."""

    written: int = 0
    failed: int = 0


async def recognize_all(
    images: Sequence[Path],
    recognizer: Recognizer,
    out: TextIO,
    tally: Tally,
    progress: bool = True,
    folder: Path | None = None,
) -> None:
    """Recognize `images` with up to `recognizer.concurrency` in flight and write a line
    for each as it is answered (flushed, so an interruption loses nothing written),
    naming its image relative to `folder` (see `line_path`). On the first exception
    (`ServerLost`) the images in flight are dropped, with no line, and it is raised."""
    from tqdm import tqdm

    queue: asyncio.Queue[Path] = asyncio.Queue()
    for path in images:
        queue.put_nowait(path)
    bar = tqdm(total=len(images), unit="image", file=sys.stderr, disable=not progress)

    async def work() -> None:
        while not queue.empty():
            path = queue.get_nowait()
            try:
                data = await asyncio.to_thread(read_image, path, recognizer.max_bytes)
            except OSError as exc:
                answer = error("unreadable", f"{path}: {exc.strerror or reason(exc)}")
            else:
                answer = await recognizer.recognize(data)
            line = {"path": line_path(path, folder), **answer}
            out.write(json_line(line))
            out.flush()
            tally.written += 1
            tally.failed += "error" in answer
            bar.update()

    workers = [asyncio.create_task(work()) for _ in range(max(1, recognizer.concurrency))]
    try:
        await asyncio.gather(*workers)
    finally:
        for worker in workers:  # after a failure, none may write to `out` once it is closed
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        bar.close()


def stop(message: str) -> int:
    """A run that cannot start or go on: one line on stderr, exit status 2."""
    print(f"texel recognize: {message}", file=sys.stderr)
    return 2


def run(
    paths: Sequence[str],
    out: str | None = None,
    url: str | None = None,
    api_key: str | None = None,
    concurrency: int | None = None,
    retry_failed: bool = False,
    progress: bool | None = None,
) -> int:
    """`texel recognize`: exit status 0 when every image has LaTeX, 1 when some failed
    (their lines say why; in a resumed run, those failed before too), 2 when the run
    could not start or the server was lost (`ServerLost`), 130 when interrupted (Ctrl-C);
    after those two, the same command again resumes. 141 when the reader of the standard
    output left, as `| head` does."""
    if concurrency is not None and concurrency < 1:
        return stop(f"--concurrency must be 1 or more, not {concurrency}")
    if url is not None and not url.strip():  # an unset variable in `--url "$SERVER"`
        return stop("--url is empty; leave it out to run the model in this process")
    sink_path = Path(out) if out is not None else None
    folder = None
    last: dict[Path, bool] = {}  # the lines already in --out
    if sink_path is not None:
        # Checked before any work: a typo in a folder name is an error, not a new folder.
        if sink_path.is_dir():
            return stop(
                f"--out {out} is a folder; give a file, such as {sink_path / 'results.jsonl'}"
            )
        if not sink_path.parent.is_dir():
            return stop(f"--out {out}: there is no folder {sink_path.parent}")
        folder = sink_path.parent.resolve()
        try:
            last = last_lines(sink_path)
        except UnicodeDecodeError:  # a picture named by mistake: left as it is
            return stop(f"--out {out} is not a JSON lines file")
    try:
        passed_over: list[Path] = []
        images = find_images(paths, passed_over)
    except RecognizeError as exc:
        return stop(str(exc))
    if passed_over:
        kinds = ", ".join(sorted(IMAGE_SUFFIXES))
        print(
            f"passed over {len(passed_over)} file(s) of the folders that are not {kinds} "
            f"(such as {passed_over[0]}); name one to send it anyway",
            file=sys.stderr,
        )
    failed_before = 0  # images left as they are whose last line is an error
    if sink_path is not None:
        done = {path for path, ok in last.items() if ok or not retry_failed}
        todo = [path for path in images if path.resolve() not in done]
        failed_before = sum(not last[p.resolve()] for p in images if p.resolve() in done)
        if len(todo) < len(images):
            failed = (
                f", {failed_before} of them failed (--retry-failed sends those again)"
                if failed_before
                else ""
            )
            print(f"{len(images) - len(todo)} images already in {out}{failed}", file=sys.stderr)
    else:
        todo = images
    if not todo:
        if not images:
            return stop("no images found")
        return 1 if failed_before else 0
    progress = sys.stderr.isatty() if progress is None else progress
    tally = Tally()

    async def main() -> None:
        recognizer = (
            ServerRecognizer(url, api_key, concurrency or 16)
            if url is not None
            else LocalRecognizer(concurrency=concurrency)
        )
        async with recognizer:
            if sink_path is None:
                await recognize_all(todo, recognizer, sys.stdout, tally, progress)
            else:
                with append_lines(sink_path) as sink:
                    await recognize_all(todo, recognizer, sink, tally, progress, folder)

    def written() -> str:
        resume = f" to {out}; run the same command again to resume" if out else ""
        return f"{tally.written} of {len(todo)} images written{resume}"

    try:
        asyncio.run(main())
    except ServerLost as exc:
        return stop(f"stopped, {exc}; {written()}")
    except RecognizeError as exc:
        return stop(str(exc))
    except KeyboardInterrupt:
        print(f"texel recognize: interrupted, {written()}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Nothing more can reach the reader; Python would fail again flushing at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if tally.failed:
        print(f"{tally.failed} of {len(todo)} images failed", file=sys.stderr)
    return 1 if tally.failed or failed_before else 0
