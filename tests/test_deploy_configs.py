"""The deployment files (the Dockerfile, deploy/compose, deploy/kubernetes) are valid and
match Texel.

Docker and a cluster are not needed: each file is parsed, the Prometheus config is
checked by the real `promtool`, the dashboard's and the autoscalers' queries are held
against a live `/metrics`, and every Kubernetes resource the kustomizations build is
validated against the Kubernetes schemas that `kubernetes-validate` ships (offline).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from prometheus_client.parser import text_string_to_metric_families

from app.launcher import shutdown_limit_s
from tests.backends import ensure_backend
from tests.conftest import ROOT, formula_png

COMPOSE = ROOT / "deploy" / "compose"
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests are meant for
AUTOSCALERS = {"ScaledObject", "HorizontalPodAutoscaler"}
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
    """Texel refuses to start on a TEXEL_* variable it does not know: a renamed or
    removed setting left in a manifest would keep every pod from starting."""
    from app import config_doc

    reference = config_doc.render()
    files = [
        ROOT / "Dockerfile",
        *yaml_files(),
        *sorted(KUBERNETES.rglob("*.yaml")),
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


def image_environment() -> dict[str, str]:
    """The `TEXEL_` variables the image's last stage sets with ENV."""
    last_stage = (ROOT / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    return dict(re.findall(r"\b(TEXEL_\w+)=(\S+)", last_stage))


def compose_seconds(duration: str) -> float:
    """A compose duration (`50s`, `1m30s`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert "".join(number + unit for number, unit in parts) == duration, duration
    return sum(float(number) * units[unit] for number, unit in parts)


def test_compose_gives_texel_its_shutdown_before_docker_kills_it(monkeypatch):
    """`docker compose stop`/`down` sends SIGKILL after the service's stop_grace_period,
    10 s when unset: shorter than Texel's shutdown, it cuts the drain short."""
    texel = load_yaml(COMPOSE / "docker-compose.yml")["services"]["texel"]
    settings = settings_from({**image_environment(), **texel["environment"]}, monkeypatch)
    assert compose_seconds(texel.get("stop_grace_period", "10s")) > shutdown_limit_s(settings)


def dockerignore_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Docker matches it: `*` and `?` within a path segment,
    `**` across segments, rooted at the context."""
    regex = ""
    for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/")):
        regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
            token, re.escape(token)
        )
    return re.compile(regex)


def in_build_context(path: str) -> bool:
    """Whether `docker build` sends the file or folder `path` (relative to the context):
    the last .dockerignore pattern that matches it or a folder above it decides, `!`
    patterns putting back what earlier ones left out."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    included = True
    for pattern in patterns:
        regex = dockerignore_pattern(pattern.removeprefix("!"))
        if any(regex.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            included = pattern.startswith("!")
    return included


def dockerfile_copy_sources() -> set[str]:
    """What the Dockerfile copies from the build context (not from another stage)."""
    sources = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            *copied, _destination = line.split()[1:]
            sources.update(copied)
    return sources


def test_the_build_context_is_what_the_dockerfile_copies():
    """Every file the image copies reaches the builder (a package's weights and page
    assets too), and nothing else does: no virtual environment, cache or scratch folder
    of the checkout is uploaded or can end up in the image."""
    copied = dockerfile_copy_sources()
    assert copied >= {"pyproject.toml", "deploy/constraints.txt", "README.md", "app", "models"}
    sent = {entry.name for entry in ROOT.iterdir() if in_build_context(entry.name)}
    assert sent == {source for source in copied if "/" not in source}
    for source in (source for source in copied if "/" in source):  # one file of a folder
        for sibling in (ROOT / source).parent.iterdir():
            relative = sibling.relative_to(ROOT).as_posix()
            assert in_build_context(relative) == (relative == source), relative
    for source in sorted(copied):
        files = [ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*")
        for path in files:
            relative = path.relative_to(ROOT).as_posix()
            if path.is_file() and "__pycache__" not in path.parts:
                assert in_build_context(relative), relative
            if path.name == "__pycache__":
                assert not in_build_context(relative), relative


def test_the_lock_pins_every_dependency_within_its_range():
    """deploy/constraints.txt (`make lock`) gives `make install` and the image one
    version of each dependency pyproject.toml names, runtime and test alike, and a
    version pyproject.toml allows."""
    pinned = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not a pin: {line}"
            pinned[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    for requirement in map(Requirement, named):
        version = pinned.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in the lock"
        assert requirement.specifier.contains(version, prereleases=True), (requirement, version)


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


# -- Kubernetes ------------------------------------------------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}


def kustomize(directory: Path) -> list[dict]:
    """What `kustomize build directory` gives for the subset of kustomize these files use
    (resources, and JSON 6902 patches with a kind and name target); a field outside that
    subset fails here, so the test's build cannot silently differ from kustomize's."""
    kustomization = load_yaml(directory / "kustomization.yaml")
    assert set(kustomization) <= KUSTOMIZATION_FIELDS, set(kustomization) - KUSTOMIZATION_FIELDS
    resources: list[dict] = []
    for entry in kustomization["resources"]:
        path = (directory / entry).resolve()
        if path.is_dir():
            resources += kustomize(path)
        else:
            with path.open() as f:
                resources += [doc for doc in yaml.safe_load_all(f) if doc]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"target", "patch"} and set(patch["target"]) == {"kind", "name"}
        (target,) = [r for r in resources if (r["kind"], r["metadata"]["name"]) == (
            patch["target"]["kind"], patch["target"]["name"])]  # fmt: skip
        for operation in yaml.safe_load(patch["patch"]):
            *parents, last = operation["path"].strip("/").split("/")
            node = target
            for key in parents:
                node = node[key]
            if operation["op"] == "remove":
                del node[last]
            else:
                assert operation["op"] in ("add", "replace"), operation
                node[last] = operation["value"]
    return resources


def the(kind: str, resources: list[dict]) -> dict:
    (resource,) = [r for r in resources if r["kind"] == kind]
    return resource


def texel_container(resources: list[dict]) -> dict:
    (container,) = the("Deployment", resources)["spec"]["template"]["spec"]["containers"]
    return container


def texel_env(resources: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in texel_container(resources)["env"] if "value" in e}


def scaled_object() -> dict:
    return the("ScaledObject", kustomize(KUBERNETES / "overlays" / "keda"))


@pytest.mark.parametrize("directory", [KUBERNETES, *OVERLAYS], ids=lambda p: p.name)
def test_every_kubernetes_resource_passes_the_kubernetes_schemas(directory):
    """Strict: a misspelt or misplaced field fails, as `kubectl apply` would refuse it.
    KEDA's resource has no schema there; the next tests check it."""
    import kubernetes_validate

    for resource in kustomize(directory):
        if not resource["apiVersion"].startswith("keda.sh/"):
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_base_is_a_deployment_a_service_and_a_disruption_budget_of_one_app():
    resources = kustomize(KUBERNETES)
    assert sorted(r["kind"] for r in resources) == ["Deployment", "PodDisruptionBudget", "Service"]
    pods = the("Deployment", resources)["spec"]["template"]["metadata"]["labels"]
    assert the("Deployment", resources)["spec"]["selector"]["matchLabels"].items() <= pods.items()
    assert the("Service", resources)["spec"]["selector"].items() <= pods.items()
    assert the("PodDisruptionBudget", resources)["spec"]["selector"]["matchLabels"].items() <= (
        pods.items()
    )
    port = the("Service", resources)["spec"]["ports"][0]["targetPort"]
    assert port in {p["name"] for p in texel_container(resources)["ports"]}


def test_every_kubernetes_file_is_applied_by_exactly_one_kustomization():
    listed = [
        (directory / entry).resolve()
        for directory in [KUBERNETES, *OVERLAYS]
        for entry in load_yaml(directory / "kustomization.yaml")["resources"]
        if not (directory / entry).is_dir()
    ]
    files = {p.resolve() for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert sorted(listed) == sorted(files)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_each_overlay_adds_one_autoscaler_that_owns_the_replica_count(overlay):
    resources = kustomize(overlay)
    (autoscaler,) = [r for r in resources if r["kind"] in AUTOSCALERS]
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == "texel"
    assert "replicas" not in the("Deployment", resources)["spec"]
    assert {p.name for p in OVERLAYS} == {"keda", "hpa"}


def test_the_keda_scaled_object_has_what_keda_requires(live_sample_names):
    """KEDA's own validation, for the fields Texel uses: a target, prometheus triggers
    whose metadata are strings (serverAddress, query, threshold), and bounds."""
    scaled = scaled_object()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["metadata"]["name"]
    deployment = the("Deployment", kustomize(KUBERNETES))
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    assert scaled["spec"]["triggers"]
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert {"serverAddress", "query", "threshold"} <= set(metadata)
        assert all(isinstance(value, str) for value in metadata.values()), metadata
        assert metadata["serverAddress"].startswith(("http://", "https://"))
        assert float(metadata["threshold"]) > 0
        assert METRIC_NAME.findall(metadata["query"]) == ["texel_queue_depth"]
        assert "texel_queue_depth" in live_sample_names


def queue_thresholds_by_model() -> dict[str, float]:
    """The KEDA triggers' `model` label and threshold."""
    thresholds = {}
    for trigger in scaled_object()["spec"]["triggers"]:
        (model,) = re.findall(r'model="([^"]+)"', trigger["metadata"]["query"])
        thresholds[model] = float(trigger["metadata"]["threshold"])
    return thresholds


def test_the_autoscalers_watch_the_queues_of_the_models_texel_ships():
    from app.settings import Settings
    from models.devices import model_name

    settings = Settings(_env_file=None)
    shipped = {model_name(str(ROOT / settings.formula.model)),
               model_name(str(ROOT / settings.image.model))}  # fmt: skip
    assert set(queue_thresholds_by_model()) == shipped


def test_the_hpa_scales_like_the_keda_object():
    hpa = the("HorizontalPodAutoscaler", kustomize(KUBERNETES / "overlays" / "hpa"))
    targets = {}
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "texel_queue_depth"
        assert metric["external"]["target"]["type"] == "AverageValue"
        model = metric["external"]["metric"]["selector"]["matchLabels"]["model"]
        targets[model] = float(metric["external"]["target"]["averageValue"])
    assert targets == queue_thresholds_by_model()
    scaled = scaled_object()["spec"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        scaled["minReplicaCount"],
        scaled["maxReplicaCount"],
    )
    assert (
        hpa["spec"]["behavior"] == scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    )


def test_the_probes_watch_livez_for_life_and_readyz_for_traffic():
    container = texel_container(kustomize(KUBERNETES))
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in ports


def settings_from(environment: dict[str, str], monkeypatch):
    """Texel's settings as this environment gives them (validated as at start)."""
    from app.settings import Settings

    for name in [n for n in os.environ if n.startswith("TEXEL_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        if name.startswith("TEXEL_"):
            monkeypatch.setenv(name, str(value))
    return Settings(_env_file=None)


def manifest_settings(monkeypatch):
    """Texel's settings as the pod's environment gives them (validated as at start)."""
    return settings_from(texel_env(kustomize(KUBERNETES)), monkeypatch)


def test_the_termination_grace_period_covers_the_shutdown_grace_and_the_drain(monkeypatch):
    """Past the period the kubelet kills the pod, and requests still draining fail."""
    settings = manifest_settings(monkeypatch)
    pod = the("Deployment", kustomize(KUBERNETES))["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > shutdown_limit_s(settings)
    assert settings.shutdown_grace_s > 0  # time for the Service to drop a draining pod


def test_the_pod_asks_for_the_cores_and_gpu_of_its_process_plan(monkeypatch):
    """One GPU, so one engine; and as many cores as the process plan gives the HTTP
    processes the manifest sets (requests equal to limits: the limit is what Texel reads
    as its cores)."""
    from app import launcher
    from app.launcher import ProcessPlan

    settings = manifest_settings(monkeypatch)
    resources = texel_container(kustomize(KUBERNETES))["resources"]
    assert resources["requests"] == resources["limits"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert settings.device == "cuda"  # every GPU the pod sees: its one
    cores = int(resources["limits"]["cpu"])
    # The plan of a pod with one GPU, computed on this machine, which may have none.
    monkeypatch.setattr(launcher, "device_names", lambda setting: ("cuda:0",))
    default = ProcessPlan.of(settings.model_copy(update={"http_processes": None}), cores=cores)
    assert default.devices == ["cuda:0"]
    assert settings.http_processes == default.http_processes


def test_the_image_runs_texel_under_an_init_that_reaps_orphans():
    """In a container the entrypoint is PID 1, which the kernel hands every orphan (the
    children of a fork server that died): tini reaps them, where texel's launcher would
    leave them zombies, and passes SIGTERM on, so that texel drains."""
    last_stage = (ROOT / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    installed = re.search(r"apt-get install [^\n]*\btini\b", last_stage)
    assert installed, "tini is not installed in the image's last stage"
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", last_stage, re.M).group(1))
    assert entrypoint[:3] == ["tini", "--", "texel"], entrypoint
