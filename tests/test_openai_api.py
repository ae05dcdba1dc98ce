"""The OpenAI-compatible routes, driven by the official `openai` client against real
servers with tiny models."""

from __future__ import annotations

import base64
import io
import time

import httpx
import openai
import pytest
from PIL import Image

from app.launcher import single_process_app
from app.settings import Settings
from tests.conftest import OPENAI_JS_HEADERS
from tests.server import serving_in_thread

PROMPT = "a red circle on a blue background"


def client_of(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_of(server.url)


def decoded(item) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item.b64_json)))


def openai_error(exc: openai.APIStatusError) -> dict:
    """The error object of the answer, checked to be in OpenAI's shape."""
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# -- images -------------------------------------------------------------------------------


def test_images_decode_as_pngs_of_the_requested_size(client):
    answer = client.images.generate(prompt=PROMPT, size="48x32", extra_body={"seed": 1, "steps": 1})
    assert abs(answer.created - time.time()) < 120
    (image,) = answer.data
    picture = decoded(image)
    assert picture.format == "PNG" and picture.size == (48, 32)


def test_n_asks_for_that_many_images_with_consecutive_seeds(client):
    answer = client.images.generate(prompt=PROMPT, n=3, extra_body={"seed": 40, "steps": 1})
    assert [item.model_extra["seed"] for item in answer.data] == [40, 41, 42]
    assert len({item.b64_json for item in answer.data}) == 3
    assert all(decoded(item).format == "PNG" for item in answer.data)


def test_an_image_through_v1_is_the_one_generate_makes(client, server):
    params = {"seed": 77, "steps": 2, "guidance_scale": 2.0, "negative_prompt": "green"}
    openai_png = client.images.generate(prompt=PROMPT, extra_body=params).data[0].b64_json
    texel = httpx.post(
        server.url + "/generate",
        json={
            "prompt": PROMPT,
            "seed": 77,
            "num_inference_steps": 2,
            "guidance_scale": 2.0,
            "negative_prompt": "green",
        },
        timeout=60,
    )
    assert texel.json()["images"][0]["png_base64"] == openai_png


STAGES = ("http.parse", "preprocess", "tokenize", "queue.wait", "generate", "postprocess")


def counts(server) -> dict[str, float]:
    """The v1 route's answered requests and the image model's stage samples, read at once."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    wanted = {
        "route": "texel_request_duration_seconds_count"
        '{route="/v1/images/generations",status="200"}',
        **{
            stage: f'texel_stage_duration_seconds_count{{model="image",stage="{stage}"}}'
            for stage in STAGES
        },
    }
    values = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        for name, series in wanted.items():
            if line.startswith(series + " "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def test_v1_images_run_the_stages_and_metrics_of_generate(client, server):
    before = counts(server)
    client.images.generate(prompt=PROMPT, extra_body={"seed": 5, "steps": 1})
    after = counts(server)
    assert {name: after[name] - before[name] for name in before} == dict.fromkeys(before, 1)


@pytest.mark.parametrize("size", ["33x33", "big", "4096x4096", "\uff13\uff12x\uff13\uff12"])
def test_a_size_texel_cannot_make_is_refused_422_in_openai_shape(client, size):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt=PROMPT, size=size)
    error = openai_error(raised.value)
    assert error["code"] == "invalid_parameter" and error["type"] == "invalid_request_error"
    assert "size" in error["message"] or "width" in error["message"]


def test_a_size_out_of_form_names_the_size_as_the_param(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt=PROMPT, size="33x33")
    assert raised.value.param == "size"


def test_a_size_over_the_servers_largest_names_the_size_as_the_param(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt=PROMPT, size="1024x2048")
    error = openai_error(raised.value)
    assert error["param"] == "size" and "height" in error["message"]


def test_a_null_n_asks_for_one_image(server):
    response = httpx.post(
        server.url + "/v1/images/generations",
        json={"prompt": PROMPT, "n": None, "seed": 4, "steps": 1},
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 1


def test_a_string_for_n_is_refused_not_converted(server):
    response = httpx.post(server.url + "/v1/images/generations", json={"prompt": PROMPT, "n": "2"})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "n"


def test_the_url_response_format_is_refused_400_saying_texel_stores_no_images(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.generate(prompt=PROMPT, response_format="url")
    error = openai_error(raised.value)
    assert error["param"] == "response_format" and error["code"] == "unsupported_response_format"
    assert "b64_json" in error["message"] and "stores no images" in error["message"]


def test_the_quality_and_style_clients_written_for_dall_e_send_change_nothing(client):
    params = {"seed": 9, "steps": 1}
    plain = client.images.generate(prompt=PROMPT, extra_body=params).data[0].b64_json
    dall_e = client.images.generate(
        prompt=PROMPT, quality="hd", style="vivid", output_format="png", extra_body=params
    )
    assert dall_e.data[0].b64_json == plain


def test_the_default_background_and_moderation_change_nothing_and_transparency_is_refused(
    client,
):
    params = {"seed": 9, "steps": 1}
    plain = client.images.generate(prompt=PROMPT, extra_body=params).data[0].b64_json
    image = client.images.generate(
        prompt=PROMPT, background="auto", moderation="auto", extra_body=params
    )
    assert image.data[0].b64_json == plain
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt=PROMPT, background="transparent")
    assert raised.value.param == "background"


def test_a_safety_identifier_changes_nothing(client):
    params = {"seed": 9, "steps": 1}
    plain = client.images.generate(prompt=PROMPT, extra_body=params).data[0].b64_json
    identified = client.images.generate(prompt=PROMPT, safety_identifier="u-1", extra_body=params)
    assert identified.data[0].b64_json == plain


def test_stream_false_asks_for_the_answer_whole(client):
    answer = client.images.generate(prompt=PROMPT, stream=False, extra_body={"steps": 1})
    assert decoded(answer.data[0]).format == "PNG"


def test_stream_true_is_refused_naming_stream(server):
    response = httpx.post(
        server.url + "/v1/images/generations", json={"prompt": PROMPT, "stream": True}
    )
    error = response.json()["error"]
    assert response.status_code == 422 and error["param"] == "stream"
    assert "not supported" in error["message"]


def test_an_output_format_other_than_png_is_refused_naming_it(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt=PROMPT, output_format="jpeg")
    error = openai_error(raised.value)
    assert error["param"] == "output_format" and "'png'" in error["message"]


@pytest.mark.parametrize(
    ("field", "value", "texel_name"), [("n", 5, "num_images"), ("steps", 5000, "inference")]
)
def test_a_refused_field_is_told_in_openais_terms_only(server, field, value, texel_name):
    response = httpx.post(
        server.url + "/v1/images/generations", json={"prompt": PROMPT, field: value}, timeout=60
    )
    error = response.json()["error"]
    assert response.status_code == 422 and error["param"] == field
    assert error["message"].startswith(f"{field}: ") and texel_name not in error["message"]


def test_steps_over_the_servers_largest_are_refused_naming_steps(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt=PROMPT, extra_body={"steps": 500})
    error = openai_error(raised.value)
    assert error["param"] == "steps", error
    assert error["message"] == "steps must be at most 100", error


def test_a_prompt_longer_than_the_text_encoder_reads_is_refused_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt="a red circle " * 40)
    error = openai_error(raised.value)
    assert error["code"] == "invalid_parameter" and "tokens" in error["message"]


def test_more_images_than_a_request_may_ask_is_refused_naming_n(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.images.generate(prompt=PROMPT, n=5)
    assert openai_error(raised.value)["param"] == "n"


def test_a_model_not_served_is_refused_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.images.generate(prompt=PROMPT, model="dall-e-3")
    error = openai_error(raised.value)
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_the_formula_model_asked_for_an_image_is_named_as_not_the_image_model(client):
    """Not "not served here": /v1/models lists it, ready."""
    formula = next(m.id for m in client.models.list() if m.task == "formula_recognition")
    with pytest.raises(openai.NotFoundError) as raised:
        client.images.generate(prompt=PROMPT, model=formula)
    assert f"{formula!r} is not this server's image model" in openai_error(raised.value)["message"]


def test_the_served_image_model_may_be_named(client):
    answer = client.images.generate(
        prompt=PROMPT, model="image", extra_body={"seed": 2, "steps": 1}
    )
    assert len(answer.data) == 1


def test_an_unknown_v1_route_answers_in_openai_shape(server):
    response = httpx.post(server.url + "/v1/chat/completions", json={})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# -- models -------------------------------------------------------------------------------


def test_v1_models_lists_the_served_models(client):
    models = {model.id: model for model in client.models.list()}
    assert set(models) == {"formula", "image"}
    assert {model.owned_by for model in models.values()} == {"texel"}
    assert all(model.object == "model" and model.created > 0 for model in models.values())


def test_the_image_model_states_its_defaults_and_limits(client):
    limits = client.models.retrieve("image").model_extra["limits"]
    assert limits["default_size"] == "32x32"
    assert (limits["max_side"], limits["max_steps"], limits["max_images"]) == (1024, 100, 4)
    assert limits["size_multiple"] == 8 and limits["default_steps"] >= 1
    assert isinstance(limits["max_prompt_tokens"], int) and limits["max_prompt_tokens"] > 2


def test_a_body_refused_by_its_content_length_is_answered_in_openai_shape(server):
    body = {"prompt": "x" * 70_000}  # past the 64 KiB of a prompt's route
    response = httpx.post(server.url + "/v1/images/generations", json=body)
    assert response.status_code == 413
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_retrieving_a_model_not_served_is_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("dall-e-3")
    assert openai_error(raised.value)["code"] == "model_not_found"


# -- API keys -----------------------------------------------------------------------------


def in_process(settings: Settings):
    """The one-process app of `settings` on a socket: its URL."""
    return serving_in_thread(single_process_app(settings))


FRONTEND = "https://frontend.example"
# The headers OpenAI's JavaScript client sends from a browser, as its preflight asks
# for them.
OPENAI_JS_REQUEST = {
    "Authorization": "Bearer sk-texel-test",
    "Content-Type": "application/json",
    "Accept": "application/json",
    **OPENAI_JS_HEADERS,
}


@pytest.fixture(scope="module")
def keyed(tiny_models):
    settings = Settings(
        device="cpu",
        api_keys=["sk-texel-test"],
        cors_origins=[FRONTEND],
        formula={"enabled": False, "model": str(tiny_models["formula"])},
        # Named as a model from the hub is by default: `org/name`. A largest side that is
        # not a multiple of the model's 8.
        image={"model": str(tiny_models["image"]), "name": "acme/texel-image", "max_side": 1020},
    )
    with in_process(settings) as url:
        yield url


def test_a_model_named_org_slash_name_is_retrieved_by_that_name(keyed):
    card = client_of(keyed, api_key="sk-texel-test").models.retrieve("acme/texel-image")
    assert card.id == "acme/texel-image"


def test_the_listed_max_side_is_the_largest_side_the_server_makes(keyed):
    client = client_of(keyed, api_key="sk-texel-test")
    side = client.models.retrieve("acme/texel-image").model_extra["limits"]["max_side"]
    assert side == 1016
    with pytest.raises(openai.UnprocessableEntityError):
        client.images.generate(prompt=PROMPT, size=f"{side + 8}x8")


def test_a_wrong_api_key_raises_authentication_error_in_openai_shape(keyed):
    with pytest.raises(openai.AuthenticationError) as raised:
        client_of(keyed, api_key="sk-wrong").images.generate(prompt=PROMPT)
    error = openai_error(raised.value)
    assert (error["code"], error["type"]) == ("unauthorized", "authentication_error")


def test_listing_models_needs_the_api_key_too(keyed):
    with pytest.raises(openai.AuthenticationError):
        client_of(keyed, api_key="sk-wrong").models.list()


def test_the_right_api_key_generates(keyed):
    answer = client_of(keyed, api_key="sk-texel-test").images.generate(
        prompt=PROMPT, extra_body={"steps": 1}
    )
    assert decoded(answer.data[0]).size == (32, 32)


def test_a_page_of_an_allowed_origin_may_send_the_headers_of_openais_js_client(keyed):
    asked = ",".join(sorted(name.lower() for name in OPENAI_JS_REQUEST))
    preflight = httpx.options(
        keyed + "/v1/images/generations",
        headers={
            "Origin": FRONTEND,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == FRONTEND
    allowed = preflight.headers["access-control-allow-headers"].lower().split(",")
    assert set(asked.split(",")) <= {name.strip() for name in allowed}
    answer = httpx.post(
        keyed + "/v1/images/generations",
        headers={**OPENAI_JS_REQUEST, "Origin": FRONTEND},
        json={"prompt": PROMPT, "steps": 1},
        timeout=60,
    )
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == FRONTEND
