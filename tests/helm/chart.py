"""Renders the Helm chart with the real ``helm`` binary (``make setup`` puts it in .cache/helm) and gives
tests the objects it produced, with small lookups for what the tests ask about."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "chatmesh"
HELM = ROOT / ".cache" / "helm" / "helm"
VALUES_DIR = Path(__file__).resolve().parent
RELEASE, NAMESPACE = "cm", "chat"
# What the chart cannot default: where Cassandra is, and the keys Envoy verifies tokens with.
REQUIRED_SETS = ("cassandra.contactPoints[0]=cassandra.db.svc", "envoy.jwt.existingSecret=chatmesh-jwks")

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")

# The minimum Kubernetes the chart supports (grpc probes are GA in 1.27) and the newest schemas shipped.
K8S_VERSIONS = ("1.27.0", "1.37.0")
CRD_KINDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
}


class HelmError(RuntimeError):
    """helm exited non-zero; the message is its stderr."""


def helm(*args: str) -> str:
    if not HELM.exists():
        raise FileNotFoundError(f"{HELM} is missing: run `make setup` (scripts/provision_helm.sh fetches it)")
    # Helm keeps caches and repository config under these; never touch the user's own.
    home = Path(tempfile.gettempdir()) / "chatmesh-helm-home"
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    result = subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    if result.returncode != 0:
        raise HelmError(result.stderr.strip() or result.stdout.strip())
    return result.stdout


def value_args(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[str]:
    args: list[str] = []
    for name in values_files:
        args += ["-f", str(VALUES_DIR / name)]
    for item in sets:
        # key=<JSON> items (values with braces or commas) go through --set-json.
        args += ["--set-json", item[len("json:") :]] if item.startswith("json:") else ["--set", item]
    return args


@dataclass
class Rendered:
    objects: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def pod_specs(self) -> Iterator[tuple[str, dict, dict]]:
        """(component, pod template metadata, pod spec) of every pod the release runs, LWS roles included."""
        for obj in self.objects:
            if obj["kind"] in WORKLOAD_KINDS:
                template = obj["spec"]["template"]
                yield component_of(template["metadata"]), template["metadata"], template["spec"]
            elif obj["kind"] == "LeaderWorkerSet":
                lws = obj["spec"]["leaderWorkerTemplate"]
                for role in ("leaderTemplate", "workerTemplate"):
                    template = lws[role]
                    yield component_of(template["metadata"]), template["metadata"], template["spec"]

    def container(self, component: str, name: str | None = None) -> dict:
        for comp, _, spec in self.pod_specs():
            if comp == component:
                for container in spec["containers"]:
                    if name is None or container["name"] == name:
                        return container
        raise AssertionError(f"no container {name or ''} in component {component}")


def component_of(metadata: dict) -> str:
    return metadata["labels"]["app.kubernetes.io/component"]


def render(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = REQUIRED_SETS) -> Rendered:
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *value_args(values_files, sets))
    return Rendered([doc for doc in yaml.safe_load_all(out) if doc])


def env_of(container: dict) -> dict[str, str | None]:
    """A container's environment: literal values, and None for values from elsewhere (fieldRef, ...)."""
    return {item["name"]: item.get("value") for item in container.get("env", [])}


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())
