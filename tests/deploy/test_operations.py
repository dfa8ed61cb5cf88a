"""The operations files parse and say what the code expects: Dockerfile, Kubernetes
manifests, systemd units (nothing here can run them: no docker or kubelet on CI)."""

from __future__ import annotations

import configparser
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

from deploy.multi_host import (
    K8S_ETCD,
    K8S_MAP_PATH,
    kubernetes_config,
    kubernetes_map_manifest,
)
from kvstore.config import cluster_from_dict

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _manifests(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_statefulset_runs_one_node_per_pod_with_a_pvc_and_grpc_health_probes() -> None:
    docs = _manifests("kvstore.yaml")
    sts = docs["StatefulSet/kvstore"]["spec"]
    seed = kubernetes_config()
    assert sts["replicas"] == len(seed.nodes), "replicas must match the seed map's nodes"
    assert (
        sts["serviceName"] == "kvstore" and docs["Service/kvstore"]["spec"]["clusterIP"] == "None"
    )
    (claim,) = sts["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"], "each pod needs its own PVC"
    pod = sts["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[:3] == ["node", "--config", "/etc/kvstore/cluster.toml"]
    assert args[args.index("--id") + 1] == "$(POD_NAME)", "the pod name must be the node id"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == seed.nodes[0].data_dir, "the PVC must hold the node's data_dir"
    assert container["readinessProbe"]["grpc"]["port"] == 50100, "grpc.health.v1 on the node"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"kvstore-0.kvstore.kvstore.svc:{ports['grpc']}" == seed.nodes[0].address
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname", "one node per host (a domain)"
    assert docs["PodDisruptionBudget/kvstore"]["spec"]["maxUnavailable"] == 1


def test_the_seed_map_configmap_is_the_generated_one_and_points_at_etcd() -> None:
    assert K8S_MAP_PATH.read_text() == kubernetes_map_manifest(kubernetes_config()), (
        "deploy/k8s/kvstore-map.yaml is stale: rerun deploy.multi_host.write_kubernetes_map"
    )
    (configmap,) = _manifests("kvstore-map.yaml").values()
    config = cluster_from_dict(tomllib.loads(configmap["data"]["cluster.toml"]))
    assert config.membership.etcd == K8S_ETCD and config.tls_enabled
    for group in config.groups:
        assert len({config.node(n).failure_domain for n in group}) == 12


def test_etcd_statefulset_serves_the_client_service_the_map_names() -> None:
    docs = _manifests("etcd.yaml")
    sts = docs["StatefulSet/etcd"]["spec"]
    assert sts["replicas"] == 3, "etcd needs an odd member count for a quorum"
    command = sts["template"]["spec"]["containers"][0]["command"]
    flags = dict(arg.split("=", 1) for arg in command[1:])
    members = flags["--initial-cluster"].split(",")
    assert len(members) == sts["replicas"]
    host, port = K8S_ETCD.rsplit(":", 1)
    assert host.split(".")[0] == docs["Service/etcd-client"]["metadata"]["name"]
    assert int(port) == docs["Service/etcd-client"]["spec"]["ports"][0]["port"]
    assert sts["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_dockerfile_installs_the_store_and_exposes_the_node_ports() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith("FROM python:3.11"), "the image must match requires-python"
    assert not any("torch" in line for line in lines), "the node image must not pull torch"
    assert re.search(r"^USER kvstore$", text, re.M) and "--uid 10001" in text
    assert re.search(r"^EXPOSE 50100 50200$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["kvstore"\]$', text, re.M)
    assert re.search(r"^USER kvstore$", text, re.M), "the node must not run as root"
    for package in ("kvstore", "erasure", "ttl", "client", "deploy"):
        assert re.search(rf"^COPY {package} ", text, re.M), f"the image lacks {package}/"


def test_systemd_units_start_nodes_after_etcd_and_etcd_defaults_form_a_cluster() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "kvstore-node@.service")
    assert "etcd.service" in unit["Unit"]["After"].split()
    command = shlex.split(unit["Service"]["ExecStart"])
    assert command[1:3] == ["node", "--config"] and command[command.index("--id") + 1] == "%i"
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "systemd" / "etcd.default").read_text().splitlines()
        if line and not line.startswith("#")
    )
    env = {k: v.strip('"') for k, v in env.items()}
    members = dict(m.split("=", 1) for m in env["ETCD_INITIAL_CLUSTER"].split(","))
    assert env["ETCD_NAME"] in members and len(members) == 3
    assert members[env["ETCD_NAME"]] == env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]
