"""The deployment files (the Dockerfile, deploy/compose, deploy/kubernetes) are valid and
match Texel.

Docker is not needed: each file is parsed, the Prometheus config is checked by the
real `promtool`, and the dashboard's queries are held against a live `/metrics`.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.backends import ensure_backend
from tests.conftest import ROOT, formula_png

COMPOSE = ROOT / "deploy" / "compose"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "texel.json"
STAGES = {"http.parse", "preprocess", "tokenize", "queue.wait", "generate", "postprocess"}
# Exported only where NVML or CUDA sees a GPU, so absent from a CPU machine's scrape.
GPU_ONLY = re.compile(r"texel_(gpu|torch)_\w+")
METRIC_NAME = re.compile(r"\btexel_\w+")
SETTING_NAME = re.compile(r"\bTEXEL_[A-Z0-9_]*[A-Z0-9]\b")


def yaml_files() -> list[Path]:
    return sorted(COMPOSE.rglob("*.yml")) + sorted(COMPOSE.rglob("*.yaml"))


def load_yaml(path: Path):
    with path.open() as f:
        return yaml.safe_load(f)


def dashboard_queries() -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and template variables."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def panel(title: str) -> dict:
    dashboard = json.loads(DASHBOARD.read_text())
    return next(p for p in dashboard["panels"] if p["title"] == title)


@pytest.fixture(scope="module")
def promtool() -> Path:
    return ensure_backend("prometheus.sh") / "promtool"


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(COMPOSE)))
def test_every_yaml_file_parses(path):
    assert isinstance(load_yaml(path), dict)


def test_the_dashboard_is_valid_json_with_a_fixed_uid():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "texel"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_compose_runs_texel_prometheus_jaeger_and_grafana():
    compose = load_yaml(COMPOSE / "docker-compose.yml")
    services = compose["services"]
    assert set(services) >= {"texel", "prometheus", "jaeger", "grafana"}
    assert (COMPOSE / services["texel"]["build"]["context"] / "Dockerfile").is_file()
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    assert services["texel"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), volume


def test_the_deployments_set_only_settings_texel_reads():
    """Texel ignores a TEXEL_* variable it does not know: a renamed or removed setting
    left in a manifest would silently do nothing."""
    from app import config_doc

    reference = config_doc.render()
    files = [
        ROOT / "Dockerfile",
        *yaml_files(),
        *sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")),
    ]
    named = {
        (path.relative_to(ROOT).as_posix(), name)
        for path in files
        for name in SETTING_NAME.findall(path.read_text())
    }
    assert {name for _, name in named} >= {"TEXEL_DEVICE", "TEXEL_LOG_FORMAT"}
    assert sorted((path, name) for path, name in named if f"`{name}`" not in reference) == []


def test_the_image_installs_every_package_texel_ships():
    """The Dockerfile copies the packages pyproject.toml installs, one by one: a package
    left out is missing from the image, and `texel serve` fails to import it."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = {
        pattern.rstrip("*")
        for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert shipped == copied


def test_prometheus_config_passes_promtool(promtool):
    result = subprocess.run(
        [str(promtool), "check", "config", str(COMPOSE / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_texel_on_its_metrics_path():
    config = load_yaml(COMPOSE / "prometheus.yml")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "texel")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert ["texel:8000"] in [c["targets"] for c in job["static_configs"]]


def test_grafana_links_prometheus_exemplars_to_the_jaeger_data_source():
    sources = load_yaml(COMPOSE / "grafana/provisioning/datasources/datasources.yml")
    by_type = {s["type"]: s for s in sources["datasources"]}
    destinations = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert {"name": "trace_id", "datasourceUid": by_type["jaeger"]["uid"]} in destinations
    assert by_type["prometheus"]["url"] == "http://prometheus:9090"
    assert by_type["jaeger"]["url"] == "http://jaeger:16686"


def test_grafana_loads_the_dashboard_folder_that_compose_mounts():
    providers = load_yaml(COMPOSE / "grafana/provisioning/dashboards/dashboards.yml")
    compose = load_yaml(COMPOSE / "docker-compose.yml")
    mounted = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    path = providers["providers"][0]["options"]["path"]
    assert (COMPOSE / mounted[path] / DASHBOARD.name).is_file()


def test_every_dashboard_panel_queries_the_provisioned_prometheus():
    sources = load_yaml(COMPOSE / "grafana/provisioning/datasources/datasources.yml")
    prometheus_uid = next(s["uid"] for s in sources["datasources"] if s["type"] == "prometheus")
    dashboard = json.loads(DASHBOARD.read_text())
    for item in dashboard["panels"]:
        for target in item.get("targets", []):
            assert target["datasource"]["uid"] == prometheus_uid, item["title"]


def test_latency_panels_show_exemplars_and_per_stage_quantiles():
    for percent, quantile in (("50", "0.5"), ("95", "0.95"), ("99", "0.99")):
        item = panel(f"Stage latency p{percent}")
        (target,) = item["targets"]
        assert target["exemplar"] is True
        assert target["expr"].startswith(f"histogram_quantile({quantile},")
        assert "by (le, stage)" in target["expr"]
    assert all(t["exemplar"] for t in panel("Request latency p50 / p95 / p99")["targets"])


def test_dashboard_covers_the_issue_s_views():
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    assert titles >= {
        "Throughput",
        "Stage latency p50",
        "Stage latency p95",
        "Stage latency p99",
        "Queue depth",
        "Batch size",
        "Padding efficiency",
        "Rejections by reason",
        "GPU and process CPU utilization",
        "GPU memory",
    }


@pytest.fixture(scope="module")
def live_sample_names(server) -> set[str]:
    """Sample names in a real scrape after traffic that touches every CPU-side metric."""
    with server.client() as client:
        ok = client.post("/recognize", files={"image": ("f.png", formula_png(), "image/png")})
        assert ok.status_code == 200, ok.text
        generated = client.post("/generate", json={"prompt": "a red square", "num_images": 1})
        assert generated.status_code == 200, generated.text
        invalid = client.post("/recognize", files={"image": ("f.png", b"not a png", "image/png")})
        assert invalid.status_code >= 400
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }


def test_dashboard_queries_only_metrics_texel_exports(live_sample_names):
    # NVML's gauges are named in the resource collector, the torch allocator's in metrics.
    telemetry_source = "".join(
        (ROOT / "telemetry" / name).read_text() for name in ("resources.py", "metrics.py")
    )
    for query in dashboard_queries():
        for name in METRIC_NAME.findall(query):
            if GPU_ONLY.fullmatch(name):
                # Not in a CPU scrape: it must at least be a name Texel exports.
                assert f'"{name}"' in telemetry_source, (name, query)
            else:
                assert name in live_sample_names, (name, query)


def test_the_live_scrape_has_every_stage_the_dashboard_breaks_down(server, live_sample_names):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    stages = {
        sample.labels["stage"]
        for family in text_string_to_metric_families(text)
        if family.name == "texel_stage_duration_seconds"
        for sample in family.samples
    }
    assert stages >= STAGES
