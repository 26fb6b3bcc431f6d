"""Static checks of deploy/: the kustomize overlays, rendered without a cluster, and the Dockerfile.

Every overlay is rendered with ``kubectl kustomize`` when kubectl is installed, else with the small renderer
in tests/kustomize_lite.py; where kubectl exists the two are also compared, so both paths stay tested.
Set CLEF_DEPLOY_RELEASE=1 to also fail on placeholder image names and digests (a release gate).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from clefserve.config import EngineConfig, add_engine_arguments
from tests import kustomize_lite

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
OVERLAYS = ("clef-serve", "reference")
ENGINE = "clef-serve"  # the overlay that runs this repository's server
KUBECTL = shutil.which("kubectl")
KUBERNETES_VERSION = "1.32.0"  # kubectl client in the machine image; validation schemas of that release

NAMESPACE = "llm-serving"
SERVICE = "clef-serve"
MODELS_CLAIM = "llm-models"
MODELS_PATH = "/mnt/models"
HTTP_PORT = 8080
# The operators' candle-vllm flags, which both implementations take verbatim.
ARGS = ["--w", "/mnt/models/clef-flash", "--d", "0", "--dtype", "f16", "--p", "8080", "--max-num-seqs", "4",
        "--kv-fraction", "0.30", "--prefill-chunk-size", "1024"]
STARTUP_BUDGET_S = 600  # loading about 20 GB of weights
GRACE_S = 60
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
PINNED_IMAGE = re.compile(r"^(?P<name>[^\s@]+?)(?::(?P<tag>[\w][\w.-]{0,127}))?@sha256:[0-9a-f]{64}$")
# An OCI reference as a container runtime accepts it: lower-case repository path, optional tag, digest.
PULLABLE_IMAGE = re.compile(
    r"^[a-z0-9.-]+(?::\d+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)+(?::[\w][\w.-]{0,127})?"
    r"@sha256:[0-9a-f]{64}$")

Object = dict[str, Any]


# ---------------------------------------------------------------------------------------------- rendering


def kubectl_render(folder: Path) -> list[Object]:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, f"kubectl kustomize {folder} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d is not None]


@functools.cache
def _render(overlay: str) -> str:
    folder = K8S / "overlays" / overlay
    objects = kubectl_render(folder) if KUBECTL else kustomize_lite.render(folder)
    return json.dumps(objects)  # cached as text, so that no test can change another test's objects


def rendered(overlay: str) -> list[Object]:
    return json.loads(_render(overlay))


def by_kind(objects: list[Object], kind: str) -> list[Object]:
    return [o for o in objects if o["kind"] == kind]


def the_deployment(overlay: str) -> Object:
    deployments = by_kind(rendered(overlay), "Deployment")
    assert len(deployments) == 1, f"{overlay}: {len(deployments)} Deployments, expected exactly one"
    return deployments[0]


def the_service(overlay: str) -> Object:
    services = by_kind(rendered(overlay), "Service")
    assert len(services) == 1, f"{overlay}: {len(services)} Services, expected exactly one"
    return services[0]


def the_container(overlay: str) -> Object:
    containers = the_deployment(overlay)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{overlay}: expected one container"
    return containers[0]


def all_containers(obj: Object) -> list[Object]:
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _sorted(objects: list[Object]) -> list[Object]:
    return sorted(objects, key=lambda o: (o["kind"], o["metadata"].get("namespace", ""),
                                          o["metadata"]["name"]))


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: only the fallback renderer runs")
@pytest.mark.parametrize("folder", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_fallback_renderer_matches_kubectl(folder: str) -> None:
    assert _sorted(kustomize_lite.render(K8S / folder)) == _sorted(kubectl_render(K8S / folder))


def test_fallback_renderer_pieces(tmp_path: Path) -> None:
    assert kustomize_lite.split_image("reg:5000/a/b:1.2@sha256:ab") == ("reg:5000/a/b", "1.2", "sha256:ab")
    assert kustomize_lite.split_image("reg:5000/a/b") == ("reg:5000/a/b", None, None)
    merged = kustomize_lite.strategic_merge(
        {"containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}]},
        {"containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}, {"name": "b", "image": "y"}]})
    assert merged == {"containers": [
        {"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
        {"name": "b", "image": "y"}]}
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(kustomize_lite.KustomizeError, match="commonLabels"):
        kustomize_lite.render(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_schema_strict(overlay: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed: "
                             "schema validation skipped (pip install kubernetes-validate)")
    errors = []
    for obj in rendered(overlay):
        try:
            kv.validate(obj, KUBERNETES_VERSION, strict=True)
        except kv.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not errors, f"{overlay} is not valid Kubernetes {KUBERNETES_VERSION}:\n" + "\n".join(errors)


# ---------------------------------------------------------------------------- one backend behind the Service


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_one_deployment_behind_the_service(overlay: str) -> None:
    objects = rendered(overlay)
    # Nothing else: in particular no PersistentVolumeClaim, the models claim already exists.
    assert sorted(o["kind"] for o in objects) == ["Deployment", "Service"]
    for obj in objects:
        assert obj["metadata"]["namespace"] == NAMESPACE
    service, deployment = the_service(overlay), the_deployment(overlay)
    assert service["metadata"]["name"] == SERVICE
    assert deployment["spec"]["replicas"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert selects(service["spec"]["selector"], labels), \
        f"{overlay}: Service selector {service['spec']['selector']} does not select the Deployment's pods"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_never_selects_another_overlays_pods(overlay: str) -> None:
    """Switching is applying the other overlay: its Service must not also select pods still running from
    this one (the Service would split traffic across two implementations)."""
    selector = the_service(overlay)["spec"]["selector"]
    for other in OVERLAYS:
        if other != overlay:
            labels = the_deployment(other)["spec"]["template"]["metadata"]["labels"]
            assert not selects(selector, labels), f"{overlay}'s Service also selects {other}'s pods"
    names = {the_deployment(o)["metadata"]["name"] for o in OVERLAYS}
    assert len(names) == len(OVERLAYS), "overlays must not share a Deployment name"
    base_selector = the_service_of(kustomize_lite.render(K8S / "base"))["spec"]["selector"]
    for other in OVERLAYS:
        assert not selects(base_selector, the_deployment(other)["spec"]["template"]["metadata"]["labels"])


def the_service_of(objects: list[Object]) -> Object:
    (service,) = by_kind(objects, "Service")
    return service


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_port_80_reaches_the_named_http_port(overlay: str) -> None:
    service = the_service(overlay)
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    ports = the_container(overlay)["ports"]
    assert ports == [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]


def test_service_and_port_are_the_same_in_every_overlay() -> None:
    """Only the selector differs: clients see the same Service whichever implementation runs."""
    def strip(service: Object) -> Object:
        service = json.loads(json.dumps(service))
        del service["spec"]["selector"]
        return service

    services = [strip(the_service(o)) for o in OVERLAYS]
    assert all(s == services[0] for s in services)


def test_reference_keeps_the_live_deployments_identity() -> None:
    """A Deployment's selector is immutable: the reference overlay must update the operators' live
    clef-candle Deployment in place, so its name and selector stay exactly as they are in the cluster."""
    deployment = the_deployment("reference")
    assert deployment["metadata"]["name"] == "clef-candle"
    assert deployment["spec"]["selector"] == {"matchLabels": {"app": "clef-candle"}}


# ------------------------------------------------------------------------------------------------- images


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_pinned_by_digest(overlay: str) -> None:
    for container in all_containers(the_deployment(overlay)):
        image = container["image"]
        match = PINNED_IMAGE.match(image)
        assert match, f"{overlay}/{container['name']}: image {image!r} is not pinned by @sha256:<64 hex>"
        assert match["tag"] != "latest", f"{overlay}: {image!r} uses the latest tag"
        assert container.get("imagePullPolicy") == "IfNotPresent", "a digest never moves: pull once"


@pytest.mark.skipif(os.environ.get("CLEF_DEPLOY_RELEASE") != "1",
                    reason="release gate: set CLEF_DEPLOY_RELEASE=1 to fail on placeholder images")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_release_images_are_real(overlay: str) -> None:
    for container in all_containers(the_deployment(overlay)):
        image = container["image"]
        assert not image.endswith(PLACEHOLDER_DIGEST), f"{overlay}: {image!r} has the placeholder digest"
        assert PULLABLE_IMAGE.match(image), f"{overlay}: {image!r} is not a pullable reference (OWNER?)"


# ----------------------------------------------------------------------------------------- the GPU pod shape


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_gpu_pod_shape(overlay: str) -> None:
    deployment = the_deployment(overlay)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["terminationGracePeriodSeconds"] >= GRACE_S
    resources = the_container(overlay)["resources"]
    for side in ("limits", "requests"):
        assert str(resources[side]["nvidia.com/gpu"]) == "1", f"{overlay}: {side} must hold exactly one GPU"
        assert {"cpu", "memory"} <= set(resources[side]), f"{overlay}: {side} need cpu and memory"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_models_claim_is_mounted_read_only(overlay: str) -> None:
    pod = the_deployment(overlay)["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"models": {"claimName": MODELS_CLAIM, "readOnly": True}}
    mounts = [m for c in all_containers(the_deployment(overlay)) for m in c.get("volumeMounts", [])
              if m["name"] in claims]
    assert mounts == [{"name": "models", "mountPath": MODELS_PATH, "readOnly": True}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_restricted_security_context(overlay: str) -> None:
    pod = the_deployment(overlay)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert "fsGroup" not in pod["securityContext"], "fsGroup would chown the shared models PVC"
    assert pod["automountServiceAccountToken"] is False
    for container in all_containers(the_deployment(overlay)):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"]["drop"] == ["ALL"]
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert "emptyDir" in tmp


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_named_port_and_allow_a_long_load(overlay: str) -> None:
    container = the_container(overlay)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        handler = probe.get("httpGet") or probe.get("tcpSocket")
        assert handler is not None, f"{overlay}: {kind} must be httpGet or tcpSocket"
        assert handler["port"] == "http", f"{overlay}: {kind} must use the named port"
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= STARTUP_BUDGET_S


# ------------------------------------------------------------------------- this engine: routes, args, auth


def engine_probe_paths() -> dict[str, str]:
    container = the_container(ENGINE)
    return {kind: container[kind]["httpGet"]["path"] for kind in ("startupProbe", "readinessProbe",
                                                                  "livenessProbe")}


def test_engine_probes_point_at_our_routes() -> None:
    from fastapi.testclient import TestClient

    from clefserve.server import create_app
    from tests.http_fakes import FakeBackend

    paths = engine_probe_paths()
    assert paths["livenessProbe"] == "/health"
    assert paths["readinessProbe"] == paths["startupProbe"] == "/ready"
    backend = FakeBackend(ready=(False, "loading the model"))
    # With an API key set, as when the optional Secret exists: probes carry no Authorization header.
    app = create_app(backend, EngineConfig(api_key="from-the-secret"))
    get_routes = {r.path for r in app.routes if "GET" in getattr(r, "methods", set())}
    assert set(paths.values()) <= get_routes
    client = TestClient(app)
    assert client.get(paths["livenessProbe"]).status_code == 200  # alive while loading
    assert client.get(paths["readinessProbe"]).status_code == 503  # no traffic until loaded
    backend.readiness = (True, "ready")
    assert client.get(paths["readinessProbe"]).status_code == 200
    assert client.get("/v1/models").status_code == 401  # the key does guard the API itself


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_args_parse_with_our_cli(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both implementations take the same flags, and clef-serve's own parser accepts them verbatim."""
    monkeypatch.delenv("CLEF_API_KEY", raising=False)
    args = the_container(overlay)["args"]
    assert args == ARGS
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    config = EngineConfig.from_args(parser.parse_args(args))
    assert config.weights is not None and config.weights.startswith(MODELS_PATH + "/")
    assert str(config.torch_device) == "cuda:0"
    assert config.dtype == "f16"  # the V100 has no bf16
    assert config.port == the_container(overlay)["ports"][0]["containerPort"]
    assert (config.max_num_seqs, config.kv_fraction, config.prefill_chunk_size) == (4, 0.30, 1024)
    from clefserve.cli import build_parser

    assert build_parser().parse_args(["serve", *args]).weights == config.weights


def test_engine_runs_the_image_entrypoint_with_an_optional_key() -> None:
    container = the_container(ENGINE)
    assert "command" not in container, "the image's ENTRYPOINT (clef-serve) must run"
    env = {e["name"]: e for e in container.get("env", [])}
    ref = env["CLEF_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True and ref["name"] and ref["key"]
    pod = the_deployment(ENGINE)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == dockerfile_uid()


# ------------------------------------------------------------------------------------------------ Dockerfile


@functools.cache
def dockerfile_instructions() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comment lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        line, pending = pending + line, ""
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return tuple(out)


def instructions(keyword: str) -> list[str]:
    return [rest for kw, rest in dockerfile_instructions() if kw == keyword]


def dockerfile_args() -> dict[str, str]:
    return dict(a.split("=", 1) for a in instructions("ARG") if "=" in a)


def dockerfile_uid() -> int:
    user = instructions("USER")[-1]
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user!r}: a numeric uid lets runAsNonRoot verify it"
    return int(user.split(":")[0])


def test_base_image_is_cuda12_pinned() -> None:
    froms = instructions("FROM")
    assert froms, "no FROM"
    for line in froms:
        image = line.split()[0]
        assert "$" not in image, "the base image must be written out, not an ARG"
        assert "latest" not in image
        assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-(base|runtime|cudnn-runtime|cudnn)-ubuntu\d{2}\.04"
                            r"(@sha256:[0-9a-f]{64})?", image), f"FROM {image}: pin a CUDA 12.x.y tag"


def test_torch_comes_from_a_cuda12_index_and_matches_the_tested_version() -> None:
    args = dockerfile_args()
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", args["TORCH_INDEX_URL"])
    pinned = (ROOT / "constraints-cpu.txt").read_text().split("torch==")[1].split()[0]
    assert args["TORCH_VERSION"] == pinned, "build the image with the torch version the tests run"
    assert args["TORCH_REQUIRED_ARCH"] == "sm_70", "the V100 nodes need sm_70 kernels"
    runs = instructions("RUN")
    assert any('--index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"' in r for r in runs)
    install = next(r for r in runs if '".[gpu]"' in r)
    assert '"torch==$TORCH_VERSION"' in install and "-c /tmp/torch-pin.txt" in install
    assert ":latest" not in DOCKERFILE.read_text()


def _arch_check_code() -> str:
    run = next(r for r in instructions("RUN") if "_cuda_getArchFlags" in r)
    code = re.search(r'python -c "([^"]*)"', run)
    assert code, "the torch check must be one python -c \"...\""
    assert "`" not in code[1] and "\\" not in code[1]
    return code[1].replace("$TORCH_REQUIRED_ARCH", dockerfile_args()["TORCH_REQUIRED_ARCH"])


@pytest.mark.parametrize(("cuda", "flags", "ok"), [
    ("12.6", "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90", True),
    ("12.8", "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", False),  # torch >= 2.11 cu128: no Volta
    ("13.0", "sm_70 sm_75 sm_80", False),
    ("12.6", "", False),
    (None, None, False),  # a CPU build: no _cuda_getArchFlags at all
])
def test_build_time_torch_check(tmp_path: Path, cuda: str | None, flags: str | None, ok: bool) -> None:
    """The Dockerfile's torch check, run here against a stand-in torch module."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "import types\n__version__ = 'fake'\n"
        f"version = types.SimpleNamespace(cuda={cuda!r})\n"
        + ("_C = types.SimpleNamespace()\n" if flags is None else
           f"_C = types.SimpleNamespace(_cuda_getArchFlags=lambda: {flags!r})\n"))
    done = subprocess.run([sys.executable, "-c", _arch_check_code()], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=False)
    assert (done.returncode == 0) == ok, done.stderr
    if not ok:
        assert "pick another TORCH_VERSION" in done.stderr


def test_project_is_installed_with_the_gpu_extra() -> None:
    assert any('pip install -c /tmp/torch-pin.txt ".[gpu]"' in r for r in instructions("RUN"))
    copies = instructions("COPY")
    sources = [s for c in copies for s in shlex.split(c)[:-1] if not s.startswith("--")]
    assert {"pyproject.toml", "README.md", "clefserve"} <= set(sources)


def test_runs_as_a_numeric_non_root_user() -> None:
    assert dockerfile_uid() != 0
    # USER comes after everything that needs root.
    keywords = [kw for kw, _ in dockerfile_instructions()]
    assert "RUN" not in keywords[keywords.index("USER"):]


def test_entrypoint_is_clef_serve_and_default_args_parse() -> None:
    assert [json.loads(e) for e in instructions("ENTRYPOINT")] == [["clef-serve"]]
    assert instructions("EXPOSE") == [str(HTTP_PORT)]
    (cmd,) = instructions("CMD")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    parsed = parser.parse_args(json.loads(cmd))
    assert parsed.port == HTTP_PORT and parsed.weights.startswith(MODELS_PATH + "/")


# ----------------------------------------------------------------------------------------- .dockerignore


def _dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = "".join(".*" if part == "**" else "[^/]*" if part == "*" else "[^/]" if part == "?"
                        else part if part.startswith("[") else re.escape(part)
                        for part in re.split(r"(\*\*|\*|\?|\[[^\]]*\])", pattern))
        rules.append((include, re.compile(regex.replace(".*/", "(?:.*/)?"))))
    return rules


def in_build_context(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for include, regex in _dockerignore_rules():
        if any(regex.fullmatch(c) for c in candidates):
            included = include
    return included


def test_dockerignore_keeps_the_context_small() -> None:
    for path in ("pyproject.toml", "README.md", "clefserve/cli.py", "clefserve/server/app.py",
                 "clefserve/demo/x.json"):
        assert in_build_context(path), path
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_cli.py", ".pytest_cache/v/x", ".ruff_cache/x",
                 ".hypothesis/x", "benchmarks/out/run.json", "clefserve/__pycache__/cli.cpython-311.pyc",
                 "clefserve.egg-info/PKG-INFO", "deploy/Dockerfile", "scripts/test.sh"):
        assert not in_build_context(path), path
    for copy in instructions("COPY"):
        for source in shlex.split(copy)[:-1]:
            assert in_build_context(source.rstrip("/")), f"COPY {source} is excluded by .dockerignore"
