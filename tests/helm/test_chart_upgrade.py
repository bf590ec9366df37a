"""Upgrades: `helm upgrade` from the previous release's chart must not change a field Kubernetes refuses to
update in place (the upgrade would fail half-applied). Renders the previous release's chart (from git) and
this one with each scenario's values of their own time and compares every object both render."""

from __future__ import annotations

import copy
import io
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import NAMESPACE, RELEASE, REQUIRED_SETS, ROOT, helm, render, value_args

# The commit of the previous release (its chart and test values); moved forward at each release, with
# protos/baseline.binpb.
PREVIOUS_RELEASE = "7400f3e"
# kind -> spec fields the API server rejects changes to (apps/v1 validation).
IMMUTABLE = {
    "StatefulSet": ("selector", "serviceName", "podManagementPolicy", "volumeClaimTemplates"),
    "Deployment": ("selector",),
    "DaemonSet": ("selector",),
}
# Scenario -> its values files under tests/helm/ (or the chart), the same names then and now.
SCENARIOS = {
    "defaults": (),
    "full": ("values-full.yaml",),
    "gpu": ("values-gpu.yaml",),
    "seeds": ("../../helm/chatmesh/values-seeds-scale.yaml",),
}


def immutable_changes(before: list[dict], after: list[dict]) -> list[str]:
    """What an upgrade from ``before`` to ``after`` would change that Kubernetes refuses to."""
    old = {(o["kind"], o["metadata"]["name"]): o for o in before}
    changes = []
    for obj in after:
        key = (obj["kind"], obj["metadata"]["name"])
        if key not in old:
            continue
        for name in IMMUTABLE.get(obj["kind"], ()):
            was, now = _normalized(old[key]["spec"].get(name)), _normalized(obj["spec"].get(name))
            if was != now:
                changes.append(f"{key[0]} {key[1]}: spec.{name} {was!r} -> {now!r}")
        # A headless Service cannot become a ClusterIP one (or back) in place.
        if obj["kind"] == "Service" and old[key]["spec"].get("clusterIP") != obj["spec"].get("clusterIP"):
            changes.append(f"Service {key[1]}: clusterIP {old[key]['spec'].get('clusterIP')!r} -> ...")
    return changes


def _normalized(value):
    """Drops what Helm or the API server fills in the same either way (labels the chart version carries)."""
    value = copy.deepcopy(value)
    for claim in value if isinstance(value, list) else []:
        labels = claim.get("metadata", {}).get("labels", {})
        for key in ("helm.sh/chart", "app.kubernetes.io/version"):
            labels.pop(key, None)
    return value


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """The previous release's checkout of helm/ and tests/helm/ (its chart and its values files)."""
    out = tmp_path_factory.mktemp("previous")
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", PREVIOUS_RELEASE, "helm/chatmesh", "tests/helm"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"the previous release {PREVIOUS_RELEASE} is not in this checkout's git history: {exc}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out, filter="data")
    return out


def _render_previous(root: Path, files: tuple[str, ...]) -> list[dict]:
    args = [a for f in files for a in ("-f", str(root / "tests" / "helm" / f))] or value_args(
        (), REQUIRED_SETS
    )
    out = helm("template", RELEASE, str(root / "helm" / "chatmesh"), "--namespace", NAMESPACE, *args)
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_upgrading_from_the_previous_release_changes_no_immutable_field(previous, scenario):
    files = SCENARIOS[scenario]
    before = _render_previous(previous, files)
    after = render(files, REQUIRED_SETS if not files else ()).objects
    assert {o["kind"] for o in before} & {"StatefulSet", "Deployment"}
    assert immutable_changes(before, after) == []


def test_a_changed_selector_or_claim_template_is_caught():
    """The check itself: what the API server would refuse is found (a seam for the test above)."""
    objects = render((), REQUIRED_SETS).objects
    changed = copy.deepcopy(objects)
    deployment = next(o for o in changed if o["kind"] == "Deployment")
    deployment["spec"]["selector"]["matchLabels"]["tier"] = "new"
    service = next(o for o in changed if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None")
    service["spec"]["clusterIP"] = ""
    statefulset = next(o for o in changed if o["kind"] == "StatefulSet")
    statefulset["spec"]["podManagementPolicy"] = "OrderedReady"
    found = immutable_changes(objects, changed)
    assert len(found) == 3, found
    assert any(f"Deployment {deployment['metadata']['name']}: spec.selector" in f for f in found)
    assert any("spec.podManagementPolicy 'Parallel' -> 'OrderedReady'" in f for f in found)
