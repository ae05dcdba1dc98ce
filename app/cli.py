"""The `texel` command: `texel serve`, `texel recognize PATH...`, `texel diagnose`."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from app.settings import CLIENT_API_KEY, InvalidSettings, Settings, read_settings

WINDOW_S = (0.5, 120.0)  # the sampling windows `GET /debug/bottleneck` takes (app/routes.py)
KEY_HELP = (
    f"the server's API key (default: ${CLIENT_API_KEY}, which other users cannot read "
    "with ps as they can a command line)"
)


def quiet_third_party() -> None:
    """Silence a notice every start printed that looks like an error and is not:
    transformers says twice that it falls back to its PIL image processors without
    torchvision, which Texel never installs. Matched by its logger and its own text, so
    any other message still shows. Run at import, so the engine and HTTP processes the
    launcher starts (which import this module again) are quiet too."""
    logging.getLogger("transformers.utils.import_utils").addFilter(
        lambda record: "requires torchvision (not installed)" not in record.getMessage()
    )


quiet_third_party()


def settings_or_exit(serving: bool) -> Settings:
    """The settings from the environment; on any problem with them, a line per problem
    and exit status 2, as a usage error, with no traceback. It also refuses what the
    command could not serve with (`Settings.serving_problems`): with `serving`, `texel
    serve`; without, `texel recognize` in its own process, which serves the formula
    model alone and, as a client, reads `TEXEL_API_KEY`."""
    try:
        settings = read_settings(client=not serving)
        if serving:
            problems = settings.serving_problems()
        else:  # with the formula model disabled, `recognize_cli.run` says so itself
            formula = settings.alone("formula")
            problems = formula.serving_problems() if formula.models() else []
    except InvalidSettings as exc:
        problems = exc.problems
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(2)
    return settings


def port(text: str) -> int:
    """A TCP port for argparse: 0 (any free port) to 65535."""
    try:
        number = int(text)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return number


def window(text: str) -> float:
    """A sampling window in seconds for argparse: what `GET /debug/bottleneck` takes."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not WINDOW_S[0] <= seconds <= WINDOW_S[1]:  # false for nan too
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a window in seconds ({WINDOW_S[0]:g} to {WINDOW_S[1]:g})"
        )
    return seconds


def client_key(given: str | None) -> str | None:
    """The API key a client command sends: `--api-key`, else `TEXEL_API_KEY` (which,
    unlike the command line, other users cannot read with `ps`)."""
    return given or os.environ.get(CLIENT_API_KEY) or None


def diagnose(url: str, window_s: float, api_key: str | None) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(
            url.rstrip("/") + "/debug/bottleneck",
            params={"window_s": window_s},
            headers=headers,
            timeout=window_s + 30,
        )
    except httpx.HTTPError as exc:
        print(f"could not reach {url}: {exc}", file=sys.stderr)
        return 2
    if response.status_code != 200:
        print(f"{url} answered {response.status_code}: {response.text}", file=sys.stderr)
        return 1
    verdict = response.json()
    gpu = verdict["gpu_utilization"]
    print(f"quadrant: {verdict['quadrant']}")
    print(f"  {verdict['explanation']}")
    print(
        f"  cpu {verdict['cpu_utilization']:.0%} of all cores, busiest thread "
        f"{verdict['busiest_thread_utilization']:.0%}, gpu "
        f"{'absent' if gpu is None else f'{gpu:.0%}'} over {verdict['window_s']:.1f} s"
    )
    wait = verdict.get("cpu_wait")
    if wait:
        print(f"  threads waited for a core {wait:.0%} of all cores' time")
    lag = verdict.get("event_loop_lag_s")
    if lag is not None:
        print(f"  event loop {lag * 1000:.1f} ms late on average")
    for stage, share in sorted(verdict["stage_shares"].items(), key=lambda kv: -kv[1]):
        print(f"  {stage:<12} {share:6.1%}")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="texel", description="Texel inference service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="serve the HTTP API")
    serve_cmd.add_argument("--host", default="0.0.0.0")
    serve_cmd.add_argument("--port", type=port, default=8000, help="0 picks a free port")
    diagnose_cmd = commands.add_parser(
        "diagnose", help="ask a running server where its bottleneck is (four quadrants)"
    )
    diagnose_cmd.add_argument("--url", default="http://127.0.0.1:8000")
    diagnose_cmd.add_argument(
        "--window", type=window, default=10.0, help="seconds to sample (0.5 to 120)"
    )
    diagnose_cmd.add_argument("--api-key", default=None, help=KEY_HELP)
    recognize_cmd = commands.add_parser(
        "recognize",
        help="formula images to LaTeX, one JSON line each (through a server, or in this process)",
    )
    recognize_cmd.add_argument("paths", nargs="+", metavar="PATH", help="images or folders")
    recognize_cmd.add_argument(
        "--out",
        default=None,
        help="JSON lines file; images already in it are skipped, so the same command "
        "resumes (lines name images relative to its folder; an image's last line counts)",
    )
    recognize_cmd.add_argument(
        "--url", default=None, help="a running server; without it the model runs in-process"
    )
    recognize_cmd.add_argument("--api-key", default=None, help=KEY_HELP)
    recognize_cmd.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="images in flight (default: 16 to a server, the formula batch size in-process)",
    )
    recognize_cmd.add_argument(
        "--retry-failed", action="store_true", help="send again the images whose line is an error"
    )
    args = parser.parse_args(argv)
    if args.command == "serve":
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # a base image's, a gunicorn habit
            print(
                "PROMETHEUS_MULTIPROC_DIR is set: texel serve sets it for its own processes, "
                "in a folder of its own; unset it",
                file=sys.stderr,
            )
            sys.exit(2)
        settings = settings_or_exit(serving=True)  # before torch: a bad setting fails fast
        from app.launcher import serve  # here: importing it reads that variable

        serve(args.host, args.port, settings)
    elif args.command == "recognize":
        from app.recognize_cli import run

        if args.url is None:  # the model runs in this process: checked as serve checks it
            settings_or_exit(serving=False)
        sys.exit(
            run(
                args.paths,
                out=args.out,
                url=args.url,
                api_key=client_key(args.api_key),
                concurrency=args.concurrency,
                retry_failed=args.retry_failed,
            )
        )
    elif args.command == "diagnose":
        sys.exit(diagnose(args.url, args.window, client_key(args.api_key)))
    else:  # pragma: no cover - argparse enforces the choices
        parser.print_help()
        sys.exit(2)


if __name__ == "__main__":
    main()
