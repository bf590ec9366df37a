"""Rendered = accepted: every values file the chart ships or the docs show renders a release whose every
chatmesh container command the service itself accepts.

For each container: the argv after the image's entrypoint (shell scripts run for real, launchers shimmed),
the launcher in front of the service (torchrun, mpirun, trtllm-llmapi-launch), and the environment go
through the service's own parser and configuration checks (engine, router, orchestrator, edge,
memory_store). An engine that asks Kubernetes for N GPUs must parse to tensor x pipeline parallel = N,
with the ranks its backend's launcher starts; every path a command names (the model, the tokenizer, the
JWKS) must be mounted, read-only, from a volume the pod has. A value that would crash-loop a pod fails
here, not in a deploy."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import kubernetes_validate
import pytest

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.model_files import bundled_model_path, model_context_length
from chatmesh.tokenizer import load_tokenizer
from engine.config import HOSTED_BACKENDS
from engine.model.cuda_runner import torchrun_world_size
from meshkit.launcher import GrpcHealthy, free_port
from orchestrator.prompting.models import ModelFile
from tests.helm.chart import (
    CHART,
    CRD_KINDS,
    K8S_VERSIONS,
    REQUIRED_SETS,
    ROOT,
    VALUES_DIR,
    Rendered,
    env_of,
    render,
)
from tests.helm.launch import SHELLS, Launch, container_argv, parse_launch, run_script, service_parsers

GPU = "nvidia.com/gpu"
# Containers that start no chatmesh service: other projects' images (Envoy, Cassandra, the collector), and
# ours that are checked elsewhere or are plain shell: Envoy's config renderer (tests/helm/test_chart.py
# runs its output through Envoy), the model copy, and the multi-node workers' sshd.
NOT_SERVICES = {"envoy", "cassandra", "otel-collector", "render-config", "copy-model", "worker"}
DOCS = (ROOT / "docs" / "deploy" / "kubernetes.md", ROOT / "docs" / "gpu.md")
# `<!-- chart-values: NAME [on BASE] -->` before a yaml fence: a values file, rendered on top of BASE's.
DOC_BLOCK = re.compile(r"<!-- chart-values: (\S+)(?: on (\S+))? -->\n```yaml\n(.*?)```", re.DOTALL)
# A LeaderWorkerSet pod's view of its group (what LWS sets), for the leader's host list.
LWS_ENV = {"LWS_LEADER_ADDRESS": "cm-chatmesh-engine-0.cm-chatmesh-engine.chat", "LWS_WORKER_INDEX": "0"}


def doc_values() -> dict[str, tuple[str, str]]:
    """The values blocks the docs mark as rendered: name -> (the block it goes on top of, its text)."""
    blocks = {}
    for doc in DOCS:
        for name, base, text in DOC_BLOCK.findall(doc.read_text()):
            assert name not in blocks, f"two doc blocks named {name}"
            blocks[name] = (base, text)
    return blocks


@dataclass
class Scenario:
    files: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()


def scenarios(tmp: Path) -> dict[str, Scenario]:
    """Every values file of tests/helm and the chart, and every doc recipe (written to ``tmp``, on top of
    the install flags docs/deploy/kubernetes.md gives first)."""
    found = {"defaults": Scenario(sets=REQUIRED_SETS)}
    for path in sorted([*VALUES_DIR.glob("values*.yaml"), *CHART.glob("values-*.yaml")]):
        found[path.name] = Scenario((str(path),))
    docs = doc_values()
    for name, (_, text) in docs.items():
        (tmp / f"{name}.yaml").write_text(text)

    def files(name: str) -> tuple[str, ...]:
        base = docs[name][0]
        return (*(files(base) if base else ()), str(tmp / f"{name}.yaml"))

    for name in docs:
        found[f"doc:{name}"] = Scenario(files(name), REQUIRED_SETS)
    # docs/deploy/kubernetes.md: "For one GPU set tensorParallelSize: 1".
    found["doc:gpu-trtllm tp1"] = Scenario(
        files("gpu-trtllm"), (*REQUIRED_SETS, "engine.tensorParallelSize=1")
    )
    assert {"gpu-trtllm", "gpu-multinode", "model-gguf", "model-image"} <= set(docs), sorted(docs)
    return found


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Rendered]:
    tmp = tmp_path_factory.mktemp("values")
    return {name: render(s.files, s.sets) for name, s in scenarios(tmp).items()}


def _parse(service: str, argv: list[str], env: dict[str, str], monkeypatch):
    """The service's own parse of ``argv`` under ``env``; a refusal (exit 2) fails with its message."""
    for name in [n for n in os.environ if n.startswith("CHATMESH_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("CHATMESH_"):
            monkeypatch.setenv(name, value)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return service_parsers()[service](argv)
    except SystemExit as exc:
        pytest.fail(
            f"{service} refuses {argv} with the chart's environment: {err.getvalue().strip()} ({exc})"
        )


def _launches(container: dict, env: dict[str, str], group_size: int, shim_dir: Path) -> list[Launch]:
    argv = container_argv(container)
    if argv and argv[0] in SHELLS and argv[1] == "-c":
        calls = run_script(argv, {**LWS_ENV, "LWS_GROUP_SIZE": str(group_size), **env}, shim_dir)
    else:
        calls = [argv]
    return [launch for launch in map(parse_launch, calls) if launch is not None]


def _mounted_path(path: str, container: dict, volumes: dict[str, dict]) -> dict:
    mounts = [
        m
        for m in container.get("volumeMounts", [])
        if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"{container['name']}: {path} is on no volume the container mounts"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert mount.get("readOnly"), f"{container['name']}: {path} is on a writable mount"
    assert mount["name"] in volumes, f"{container['name']}: mount {mount['name']} has no volume"
    return volumes[mount["name"]]


def _check_engine(args, config, launch: Launch, container: dict, group_size: int) -> None:
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.backend in HOSTED_BACKENDS:  # they refuse the bundled GGUF at start
        assert config.model_path is not None, f"--backend {config.backend} without a Hugging Face directory"
    gpus = int(container.get("resources", {}).get("limits", {}).get(GPU, 0)) * group_size
    if config.backend in ("cuda", "trtllm"):
        assert gpus == tp * pp, f"{config.backend}: {gpus} GPUs asked for, tensor x pipeline = {tp} x {pp}"
    else:
        assert gpus == 0, f"--backend {config.backend} computes on no GPU of its pod, yet asks for {gpus}"
    if config.backend == "cuda" and tp > 1:
        assert launch.launcher == "torchrun"
        torchrun_world_size(tp, {"WORLD_SIZE": str(launch.ranks)})  # what the engine checks at start
    elif config.backend == "trtllm" and group_size > 1:
        # Across nodes: every rank started by mpirun, each host's slots its GPUs.
        assert launch.launcher == "mpirun" and launch.mpi_program == ["trtllm-llmapi-launch"]
        assert launch.ranks == tp * pp == sum(slots for _, slots in launch.mpi_hosts)
        assert len(launch.mpi_hosts) == group_size
        assert {slots for _, slots in launch.mpi_hosts} == {gpus // group_size}
    elif config.backend == "trtllm" and tp * pp > 1:
        # One node: an MPI singleton; TensorRT-LLM's LLM API spawns the other ranks.
        assert (launch.launcher, launch.ranks, launch.mpi_program) == ("mpirun", 1, [])
    else:
        assert launch.launcher == "", f"--backend {config.backend} at {tp} x {pp} needs no launcher"
    if launch.launcher == "mpirun":
        # mpirun kills its ranks this long after passing SIGTERM on: never before the engine's drain ends.
        assert float(launch.mpi_mca["odls_base_sigkill_timeout"]) > args.drain_grace_s


def test_every_values_file_and_doc_recipe_renders_commands_the_services_accept(
    releases, tmp_path, monkeypatch
):
    checked: dict[str, set[str]] = {}
    for scenario, chart in releases.items():
        services: set[str] = set()
        models: dict[str, set] = {"engine": set(), "orchestrator": set()}
        groups: list[list[dict]] = []
        for obj in chart.objects:
            for spec, group_size in _pods(obj):
                volumes = {v["name"]: v for v in spec.get("volumes", [])}
                for container in spec.get("initContainers", []) + spec["containers"]:
                    if container["name"] in NOT_SERVICES:
                        continue
                    env = {k: v if v is not None else "from-the-pod" for k, v in env_of(container).items()}
                    launches = _launches(container, env, group_size, tmp_path)
                    assert launches, f"{scenario}: {container['name']} starts no chatmesh service"
                    for launch in launches:
                        args, config = _parse(launch.service, launch.args, env, monkeypatch)
                        services.add(launch.service)
                        where = f"{scenario}: {container['name']}"
                        if launch.service == "engine":
                            _check_engine(args, config, launch, container, group_size)
                            models["engine"].add(config.model_path)
                            if config.model_path is not None:
                                _mounted_path(str(config.model_path), container, volumes)
                        if launch.service == "orchestrator":
                            files = [str(ModelFile.parse(flag).path) for flag in config.model_files]
                            models["orchestrator"].update(files or [""])
                            for file in files:
                                _mounted_path(file, container, volumes)
                        if launch.service in ("orchestrator", "edge"):
                            jwks = env[f"CHATMESH_{launch.service.upper()}_JWKS_FILE"]
                            assert _mounted_path(jwks, container, volumes)["secret"], where
                if group_size > 1:  # every pod of a group mounts what the leader's ranks read
                    mounts = [
                        {k: m[k] for k in ("name", "mountPath")}
                        for m in spec["containers"][0]["volumeMounts"]
                    ]
                    groups.append(mounts)
        # The orchestrator reads the tokenizer of the model the engines serve (or both the bundled one).
        assert {str(p) if p else "" for p in models["engine"]} == models["orchestrator"], scenario
        assert all(m == groups[0] for m in groups), f"{scenario}: leader and workers mount different volumes"
        checked[scenario] = services
    for scenario, services in checked.items():
        assert {"engine", "router", "orchestrator", "edge", "memory_store"} <= services, scenario


def _pods(obj: dict):
    """(pod spec, the pod's group size: 1 but in a LeaderWorkerSet) of each pod template in ``obj``."""
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        yield obj["spec"]["template"]["spec"], 1
    elif obj["kind"] == "LeaderWorkerSet":
        lws = obj["spec"]["leaderWorkerTemplate"]
        yield lws["leaderTemplate"]["spec"], lws["size"]
        yield lws["workerTemplate"]["spec"], lws["size"]


def test_doc_recipes_render_objects_kubernetes_accepts(releases):
    """The recipes' objects pass the API's schema (strict: no unknown field), the LeaderWorkerSet's
    templates as Pods; the newest schemas, since image volumes need Kubernetes 1.33+."""
    for scenario, chart in releases.items():
        if not scenario.startswith("doc:"):
            continue
        for obj in chart.objects:
            if obj["kind"] == "LeaderWorkerSet":
                lws = obj["spec"]["leaderWorkerTemplate"]
                objects = [
                    {"apiVersion": "v1", "kind": "Pod", **lws[r]}
                    for r in ("leaderTemplate", "workerTemplate")
                ]
                for pod in objects:
                    pod["metadata"] = {"name": "lws-pod", **pod["metadata"]}
            elif obj["kind"] in CRD_KINDS:
                continue
            else:
                objects = [obj]
            for item in objects:
                try:
                    kubernetes_validate.validate(item, K8S_VERSIONS[-1], strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"{scenario}: {item['kind']} {item['metadata']['name']}: {exc.message}")


def test_the_rendered_cpu_engine_serves_the_mounted_model_the_orchestrator_reads(tmp_path):
    """The rendered command, run: the engine container's argv and environment from a release whose model
    volume is a host path holding the bundled GGUF (mounted where it lies here, so the rendered path is
    real), started as the pod would start it (ports moved to free ones). It serves that model, with the
    tokenizer and context window the orchestrator's rendered --model-file gives it."""
    model = bundled_model_path()
    chart = render(
        (),
        (
            *REQUIRED_SETS,
            f"model.path={model.name}",
            "model.source=hostPath",
            f"model.hostPath.path={model.parent}",
            f"model.mountPath={model.parent}",
        ),
    )
    engine = chart.container("engine", "engine")
    [launch] = _launches(engine, env_of(engine), 1, tmp_path)
    orchestrator_model = env_of(chart.container("orchestrator", "orchestrator"))[
        "CHATMESH_ORCHESTRATOR_MODEL_FILE"
    ]
    port = free_port()
    env = {k: v if v is not None else "engine-0" for k, v in env_of(engine).items()}
    env |= {
        "CHATMESH_ENGINE_PORT": str(port),
        "CHATMESH_ENGINE_METRICS_PORT": "0",
        "CHATMESH_ENGINE_HOST": "127.0.0.1",
    }
    log = tmp_path / "engine.log"
    process = subprocess.Popen(
        [sys.executable, "-m", launch.service, *launch.args],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("CHATMESH_")}, **env},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    try:
        deadline = time.monotonic() + 120
        while not GrpcHealthy(port)():
            assert process.poll() is None, f"the rendered engine exited: {log.read_text()}"
            assert time.monotonic() < deadline, "the rendered engine did not become healthy in 120 s"
            time.sleep(0.5)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(
                engine_pb2.GetModelInfoRequest(), timeout=10
            )
    finally:
        process.terminate()
        process.wait(timeout=60)
    tokenizer = load_tokenizer(orchestrator_model)
    assert orchestrator_model == env["CHATMESH_ENGINE_MODEL"] == str(model)
    assert (info.model, info.tokenizer_fingerprint) == (tokenizer.model_name, tokenizer.fingerprint)
    assert info.context_length == model_context_length(Path(orchestrator_model))
