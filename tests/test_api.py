"""The HTTP API against a real server on a socket, with tiny models built from configs."""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import io
import shutil
import struct
import time
import zlib

import httpx
import pytest
import safetensors.torch
from PIL import Image

from app.http import preferred_type
from app.routes import GENERATE_ANSWERS
from telemetry.metrics import REJECTION_REASONS
from tests.conftest import formula_png

STAGES = {"http.parse", "preprocess", "queue.wait", "generate", "tokenize", "postprocess"}


# -- /recognize -------------------------------------------------------------------


def test_recognize_accepts_a_multipart_upload_and_reports_its_stages(server):
    # A picture no other test sends: the session's server may have answered the default
    # one already, and then answers it from its cache, without the model's stages.
    data = formula_png("r_7 - 3")
    with server.client() as client:
        response = client.post("/recognize", files={"image": ("f.png", data, "image/png")})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["latex"], str)
    assert body["model"] == "formula"
    assert body["batch_size"] >= 1
    assert set(body["timings_ms"]) == STAGES


def test_recognize_says_how_sure_it_is_and_nothing_for_a_picture_without_ink(server):
    blank = io.BytesIO()
    Image.new("RGB", (160, 48), "white").save(blank, "PNG")
    with server.client() as client:
        read = client.post("/recognize", files={"image": ("f.png", formula_png(), "image/png")})
        empty = client.post("/recognize", files={"image": ("b.png", blank.getvalue(), "image/png")})
    assert read.status_code == empty.status_code == 200, (read.text, empty.text)
    assert 0 < read.json()["confidence"] <= 1
    assert (empty.json()["latex"], empty.json()["confidence"]) == ("", None)


def test_a_model_whose_scores_are_not_numbers_still_answers_without_a_confidence(
    tiny_models, tmp_path
):
    """A checkpoint that overflows (NaN scores, as a half-precision model can) still gets
    its answer out: JSON has no NaN, so the confidence is null, and the confidence
    histogram keeps counting real numbers only. (The one-process app on a socket in this
    process: what is checked is the app's, and a server process costs seconds to start.)"""
    from app.launcher import single_process_app
    from app.settings import Settings
    from tests.server import serving_in_thread

    model = tmp_path / "formula-nan"
    shutil.copytree(tiny_models["formula"], model)
    weights = safetensors.torch.load_file(str(model / "model.safetensors"))
    norms = sorted(k for k in weights if k.endswith("final_layer_norm.bias") and "decoder" in k)
    weights[norms[-1]].fill_(float("nan"))
    safetensors.torch.save_file(weights, str(model / "model.safetensors"))
    settings = Settings(
        device="cpu",
        formula={"model": str(model)},
        image={"enabled": False, "model": str(tiny_models["image"])},
    )
    with (
        serving_in_thread(single_process_app(settings)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        read = client.post("/recognize", files={"image": ("f.png", formula_png(), "image/png")})
        metrics = client.get("/metrics").text
    assert read.status_code == 200, read.text
    assert read.json()["confidence"] is None
    histogram = [line for line in metrics.splitlines() if line.startswith("texel_confidence")]
    assert not [line for line in histogram if "nan" in line.lower()], histogram


def test_recognize_accepts_base64_json_and_the_image_as_the_body(server):
    # multipart, base64 (standard, URL-safe unpadded, in 76-character lines, a data URL), raw
    data = formula_png("a^2 + b, as a body")
    encoded = base64.b64encode(data).decode()
    url_safe = base64.urlsafe_b64encode(data).decode().rstrip("=")
    assert url_safe != encoded.rstrip("="), "the picture's base64 must use + or /"
    with server.client() as client:
        answers = [
            client.post("/recognize", files={"image": ("f.png", data, "image/png")}),
            client.post("/recognize", json={"image_base64": encoded}),
            client.post("/recognize", json={"image_base64": url_safe}),
            client.post("/recognize", json={"image_base64": base64.encodebytes(data).decode()}),
            client.post("/recognize", json={"image_base64": "data:image/png;base64," + encoded}),
            client.post("/recognize", content=data, headers={"content-type": "image/png"}),
            client.post(
                "/recognize", content=data, headers={"content-type": "application/octet-stream"}
            ),
        ]
    for response in answers:
        assert response.status_code == 200, response.text
    assert len({response.json()["latex"] for response in answers}) == 1


def test_recognize_accepts_every_supported_format(server):
    with server.client() as client:
        for fmt in ("PNG", "JPEG", "MPO", "WEBP", "BMP", "GIF"):
            data = formula_png(fmt=fmt)
            response = client.post("/recognize", files={"image": ("f", data, "application/x")})
            assert response.status_code == 200, (fmt, response.text)


def test_concurrent_formulas_of_one_width_share_a_batch(server):
    # A picture no other test sends: one answered before would come from the cache.
    data = formula_png("x^2 + 1, batched")

    def post(_):
        with server.client() as client:
            return client.post("/recognize", files={"image": ("f.png", data, "image/png")})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
    assert all(r.status_code == 200 for r in responses)
    assert max(r.json()["batch_size"] for r in responses) > 1
    # Identical inputs give identical outputs, whatever batch they ran in.
    assert len({r.json()["latex"] for r in responses}) == 1


# -- /generate --------------------------------------------------------------------


def generate(server, **params) -> httpx.Response:
    with server.client() as client:
        return client.post(
            "/generate", json={"prompt": "a red circle on a blue background", **params}
        )


def test_generate_returns_pngs_of_the_model_default_size_with_their_seeds(server):
    response = generate(server, seed=7, num_images=2)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [img["seed"] for img in body["images"]] == [7, 8]
    for item in body["images"]:
        image = Image.open(io.BytesIO(base64.b64decode(item["png_base64"])))
        assert image.format == "PNG" and image.size == (32, 32)
    assert set(body["timings_ms"]) == STAGES


def test_the_same_seed_and_parameters_give_the_same_image(server):
    first = generate(server, seed=1234).json()["images"][0]["png_base64"]
    second = generate(server, seed=1234).json()["images"][0]["png_base64"]
    other = generate(server, seed=4321).json()["images"][0]["png_base64"]
    assert first == second
    assert first != other


def test_an_image_does_not_depend_on_the_batch_it_ran_in(server):
    alone = generate(server, seed=99).json()["images"][0]["png_base64"]

    def post(i):
        if i == 0:
            return generate(server, seed=99)
        return generate(server, seed=i, prompt=f"green squares {i}")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(post, range(4)))
    assert max(r.json()["batch_size"] for r in responses) > 1
    batched = responses[0].json()["images"][0]["png_base64"]
    a = Image.open(io.BytesIO(base64.b64decode(alone)))
    b = Image.open(io.BytesIO(base64.b64decode(batched)))
    diff = max(
        abs(x - y)
        for p, q in zip(a.getdata(), b.getdata(), strict=True)
        for x, y in zip(p, q, strict=True)
    )
    assert diff <= 2  # float rounding in a larger batch at most


def test_generate_answers_with_the_png_itself_when_asked(server):
    with server.client() as client:
        response = client.post(
            "/generate", json={"prompt": "a square", "seed": 3}, headers={"Accept": "image/png"}
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "image/png"
    assert response.headers["x-texel-seed"] == "3"
    assert Image.open(io.BytesIO(response.content)).format == "PNG"


def test_generate_answers_the_type_the_accept_header_prefers(server):
    asked = {
        "image/*": "image/png",  # what a browser's <img> sends, in essence
        "image/png, */*": "image/png",
        "application/json, image/png;q=0.5": "application/json",
        "image/png;q=0.2, application/json;q=0.9": "application/json",
        "image/png;q=0, */*": "application/json",
        "*/*": "application/json",
        "image/webp": "application/json",  # nothing it can make: its default
    }
    with server.client() as client:
        for accept, expected in asked.items():
            response = client.post(
                "/generate", json={"prompt": "a square", "seed": 3}, headers={"Accept": accept}
            )
            assert response.status_code == 200, (accept, response.text)
            assert response.headers["content-type"].split(";")[0] == expected, accept


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        ("", "application/json"),
        ("text/event-stream", "text/event-stream"),
        ("text/*;q=0.9, image/*;q=0.8", "text/event-stream"),
        ("IMAGE/PNG", "image/png"),
        ("image/png;q=abc", "application/json"),
        ("image/*;q=0.5, image/png;q=0", "application/json"),
    ],
)
def test_content_negotiation_follows_quality_then_specificity(accept, expected):
    assert preferred_type(accept, GENERATE_ANSWERS) == expected


# -- health, metrics, docs ----------------------------------------------------------


def test_health_endpoints_report_live_and_ready(server):
    assert httpx.get(server.url + "/livez").status_code == 200
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["models"] == {"formula": "ready", "image": "ready"}
    # Said at start, before the models' own lines: they load after the port opens.
    assert "loading the models: GET /readyz answers 200 once they are ready" in server.log(10**7)


def test_metrics_expose_stage_histograms_batches_and_padding(server):
    generate(server, seed=1)
    with server.client() as client:
        client.post("/recognize", files={"image": ("f.png", formula_png(), "image/png")})
        text = client.get("/metrics").text
    for stage in STAGES:
        assert f'texel_stage_duration_seconds_count{{model="formula",stage="{stage}"}}' in text
    assert 'texel_request_duration_seconds_count{route="/recognize",status="200"}' in text
    assert "texel_batch_size_bucket" in text
    assert 'texel_queue_depth{model="formula"}' in text
    assert 'texel_padding_efficiency_count{model="formula"}' in text
    assert 'texel_confidence_count{model="formula"}' in text


def test_every_rejection_reason_is_a_series_from_the_start(server):
    """Created at 0 when the server starts, so `rate()` sees a model's first refusal of
    each reason, and a dashboard shows 0, not "no data", for one that never happened."""
    text = httpx.get(server.url + "/metrics").text
    for model in ("formula", "image"):
        for reason in REJECTION_REASONS:
            series = f'texel_requests_rejected_total{{model="{model}",reason="{reason}"}}'
            assert series in text, series


def test_metrics_speak_openmetrics_with_exemplars_when_asked(server):
    with server.client() as client:
        client.post("/recognize", files={"image": ("f.png", formula_png(), "image/png")})
        response = client.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert '# {trace_id="' in response.text
    assert response.text.rstrip().endswith("# EOF")


def openapi_refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in openapi_refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in openapi_refs(value)]
    return []


def test_openapi_has_no_dangling_refs(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    refs = openapi_refs(spec)
    assert refs
    for ref in refs:
        target = spec
        for part in ref.removeprefix("#/").split("/"):
            assert part in target, f"{ref} points nowhere"
            target = target[part]


def test_openapi_states_the_limits_the_server_enforces(server):
    """The shared server runs the image model's default limits: sides up to 1024 in
    multiples of 8, up to 100 steps, 1 to 4 images."""
    spec = httpx.get(server.url + "/openapi.json").json()
    body = spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
    fields = body["schema"]["properties"]

    def integer(name):
        return next(f for f in fields[name].get("anyOf", [fields[name]]) if f["type"] == "integer")

    for side in ("width", "height"):
        assert (integer(side)["maximum"], integer(side)["multipleOf"]) == (1024, 8)
    assert integer("num_inference_steps")["maximum"] == 100
    assert (integer("num_images")["minimum"], integer("num_images")["maximum"]) == (1, 4)
    assert generate(server, width=1024 + 8).status_code == 422
    assert generate(server, num_inference_steps=101).status_code == 422
    recognize = spec["paths"]["/recognize"]["post"]["requestBody"]["content"]
    described = recognize["application/json"]["schema"]["properties"]["image_base64"]
    assert str(256 * 1024) in described["description"]


def test_a_wrong_method_gets_405_naming_the_allowed_ones(server):
    response = httpx.get(server.url + "/recognize")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert error_of(response) == "method_not_allowed"


def test_an_unknown_json_field_gets_422_on_both_routes(server):
    encoded = base64.b64encode(formula_png()).decode()
    with server.client() as client:
        cases = [
            client.post("/recognize", json={"image_base64": encoded, "colour": "red"}),
            client.post("/recognize", json={"picture": "abc"}),
            client.post("/generate", json={"prompt": "a square", "colour": "red"}),
        ]
    for response in cases:
        assert response.status_code == 422, response.text
        assert error_of(response) == "invalid_parameter"
        assert "Extra inputs" in response.json()["error"]["message"]


def test_an_empty_body_gets_400_on_both_routes(server):
    with server.client() as client:
        for path in ("/recognize", "/generate"):
            for headers in ({"content-type": "application/json"}, {}):
                response = client.post(path, content=b"", headers=headers)
                assert response.status_code == 400, (path, headers, response.text)
                assert error_of(response) == "malformed_request"
                if path == "/recognize":  # every form it takes, multipart first
                    assert "multipart/form-data with an 'image' file" in response.text


def test_text_and_form_bodies_get_415_on_both_routes(server):
    with server.client() as client:
        for path in ("/recognize", "/generate"):
            cases = [
                client.post(path, content=b"a square", headers={"content-type": "text/plain"}),
                client.post(path, data={"prompt": "a square"}),
            ]
            for response in cases:
                assert response.status_code == 415, (path, response.text)
                assert error_of(response) == "unsupported_media_type"
        response = client.post("/generate", files={"image": ("f.png", formula_png(), "image/png")})
        assert response.status_code == 415


def test_openapi_documents_both_routes(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/recognize", "/generate", "/livez", "/readyz", "/metrics"} <= set(spec["paths"])
    content = spec["paths"]["/recognize"]["post"]["requestBody"]["content"]
    assert {"multipart/form-data", "application/json", "image/*"} <= set(content)
    assert httpx.get(server.url + "/docs").status_code == 200


# -- bad input: 4xx, never 5xx ----------------------------------------------------


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    return body["error"]["code"]


def test_malformed_requests_get_400(server):
    with server.client() as client:
        cases = [
            client.post("/recognize", json={"image_base64": "not base64!"}),
            client.post(
                "/recognize", content=b"{oops", headers={"content-type": "application/json"}
            ),
            client.post("/recognize", files={"file": ("f.png", formula_png(), "image/png")}),
            client.post(
                "/generate", content=b"{oops", headers={"content-type": "application/json"}
            ),
        ]
    for response in cases:
        assert response.status_code == 400, response.text
        error_of(response)


def test_a_truncated_image_of_a_known_format_gets_400(server):
    data = formula_png()[:200]
    with server.client() as client:
        response = client.post("/recognize", files={"image": ("f.png", data, "image/png")})
    assert response.status_code == 400
    assert error_of(response) == "corrupt_image"


def test_an_unsupported_image_gets_415(server):
    tiff = io.BytesIO()
    Image.new("L", (40, 20), 255).save(tiff, format="TIFF")
    with server.client() as client:
        for data in (b"plain text, not an image", tiff.getvalue()):
            response = client.post("/recognize", files={"image": ("f", data, "image/png")})
            assert response.status_code == 415, response.text
            assert error_of(response) == "unsupported_image"
        response = client.post("/recognize", content=b"raw", headers={"content-type": "text/plain"})
        assert response.status_code == 415
        response = client.post("/recognize", content=b"raw", headers={"content-type": "image/png"})
        assert response.status_code == 415
        assert error_of(response) == "unsupported_image"


def test_an_upload_over_the_byte_limit_gets_413(server):
    big = b"\x89PNG" + b"\0" * (300 * 1024)  # the server's limit is 256 KiB
    with server.client() as client:
        response = client.post("/recognize", files={"image": ("f.png", big, "image/png")})
        assert response.status_code == 413
        encoded = base64.b64encode(big).decode()
        assert client.post("/recognize", json={"image_base64": encoded}).status_code == 413
        raw = client.post("/recognize", content=big, headers={"content-type": "image/png"})
        assert raw.status_code == 413


def decompression_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of width x height white pixels: huge when decoded, tiny on the wire."""
    row = b"\x00" + b"\xff" * ((width + 7) // 8)
    raw = zlib.compress(row * height, 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_decoding_with_413(server):
    bomb = decompression_bomb(10_000, 10_000)  # 100 megapixels in a few kilobytes
    assert len(bomb) < 256 * 1024
    with server.client() as client:
        response = client.post("/recognize", files={"image": ("bomb.png", bomb, "image/png")})
    assert response.status_code == 413
    assert error_of(response) == "image_too_large"


def test_out_of_range_generation_parameters_get_422(server):
    cases = [
        {"num_images": 5},
        {"num_images": 0},
        {"num_inference_steps": 0},
        {"guidance_scale": -1},
        {"width": 33},
        {"width": 2048},
        {"seed": -1},
        {"prompt": ""},
        {"colour": "red"},
    ]
    for params in cases:
        response = generate(server, **params)
        assert response.status_code == 422, (params, response.text)
        assert error_of(response) == "invalid_parameter"


@pytest.mark.parametrize(
    "params",
    [
        {"width": "64"},
        {"width": True},
        {"seed": "42"},
        {"seed": True},
        {"seed": 1.5},
        {"num_images": "2"},
        {"guidance_scale": "7.5"},
        {"prompt": 7},
    ],
    ids=repr,
)
def test_a_field_of_the_wrong_json_type_gets_422_not_a_conversion(server, params):
    response = generate(server, **params)
    assert response.status_code == 422, (params, response.text)
    assert error_of(response) == "invalid_parameter"
    assert "valid" in response.json()["error"]["message"]


def test_a_guidance_scale_that_is_not_a_finite_number_gets_422_saying_so(server):
    for raw in ("NaN", "Infinity"):
        response = httpx.post(
            server.url + "/generate",
            content=f'{{"prompt": "a red circle", "guidance_scale": {raw}}}',
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 422, (raw, response.text)
        assert "finite number" in response.json()["error"]["message"]


def test_a_whole_number_for_a_decimal_field_is_taken(server):
    response = generate(server, guidance_scale=2, num_inference_steps=1, seed=3)
    assert response.status_code == 200, response.text


def test_an_empty_image_base64_gets_400_as_an_empty_body_does(server):
    response = httpx.post(server.url + "/recognize", json={"image_base64": ""})
    assert response.status_code == 400, response.text
    assert error_of(response) == "malformed_request"


def test_a_prompt_longer_than_the_text_encoder_reads_gets_422(server):
    response = generate(server, prompt="a red circle " * 20)
    assert response.status_code == 422
    assert "tokens" in response.json()["error"]["message"]


def test_a_negative_prompt_longer_than_the_text_encoder_reads_gets_422_too(server):
    """Not cut short silently: the image would ignore what the user asked it to avoid."""
    response = generate(server, prompt="a circle", negative_prompt="a red square " * 20)
    assert response.status_code == 422
    error = response.json()["error"]
    assert "negative_prompt" in error["message"] and "tokens" in error["message"], error


def test_bad_requests_leave_the_server_healthy(server):
    with server.client() as client:
        client.post("/recognize", files={"image": ("f", b"junk", "image/png")})
        response = client.post("/recognize", files={"image": ("f.png", formula_png(), "image/png")})
    assert response.status_code == 200
    assert server.metric("texel_requests_rejected_total", model="formula", reason="invalid") >= 1


def test_unknown_routes_get_a_json_404(server):
    response = httpx.get(server.url + "/nope")
    assert response.status_code == 404
    assert error_of(response) == "not_found"


def test_a_trailing_slash_gets_a_404_naming_the_route_not_a_redirect(server):
    """A redirect would name whatever host the client sent, and clients do not follow a
    POST's redirect by default: the answer says where the route is instead."""
    response = httpx.post(
        server.url + "/recognize/", files={"image": ("f.png", formula_png(), "image/png")}
    )
    assert response.status_code == 404 and "location" not in response.headers
    assert error_of(response) == "not_found"
    assert "the route is /recognize," in response.json()["error"]["message"]
    assert "the route is" not in httpx.get(server.url + "/nope/").json()["error"]["message"]


# -- connections --------------------------------------------------------------------


def test_an_idle_connection_stays_open_past_uvicorns_own_keep_alive(server):
    """uvicorn closes a connection idle for 5 s, which clients and proxies still count
    as open; Texel keeps it TEXEL_ADVANCED__KEEP_ALIVE_S (75 s by default)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        connection.request("GET", "/livez")
        first = connection.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        time.sleep(6)
        connection.request("GET", "/livez")  # on the same socket: it would fail if closed
        assert connection.getresponse().status == 200
    finally:
        connection.close()


def test_a_seed_that_would_give_an_image_a_seed_past_the_largest_gets_422_naming_it(server):
    """Image i uses seed + i, and every seed answered must be one a request may send."""
    last = 2**32 - 1
    refused = generate(server, seed=last, num_images=2, num_inference_steps=1)
    assert refused.status_code == 422, refused.text
    assert error_of(refused) == "invalid_parameter"
    assert f"seed must be at most {last - 1} for 2 images" in refused.json()["error"]["message"]
    with server.client() as client:
        v1 = client.post(
            "/v1/images/generations",
            json={"prompt": "a red circle", "n": 2, "seed": last, "steps": 1},
        )
    assert v1.status_code == 422, v1.text
    assert (v1.json()["error"]["code"], v1.json()["error"]["param"]) == (
        "invalid_parameter",
        "seed",
    )
    accepted = generate(server, seed=last - 1, num_images=2, num_inference_steps=1)
    assert accepted.status_code == 200, accepted.text
    assert [image["seed"] for image in accepted.json()["images"]] == [last - 1, last]
