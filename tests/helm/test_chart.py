"""The Helm chart: it lints, renders valid Kubernetes objects, and wires the services the way the code
expects (ports, flags, discovery, network paths, GPUs, drain). Rendered with the real helm binary; the
services' own flag parsers and Envoy's own validator judge what it renders."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import re
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml

from chatmesh import errors
from localmesh.dev_jwt import generate_keys
from meshkit.envoy import EnvoyConfig, chat_service_methods, write_config
from orchestrator.prompting.models import ModelFile
from tests.helm.chart import (
    CHART,
    CRD_KINDS,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    REQUIRED_SETS,
    HelmError,
    Rendered,
    component_of,
    env_of,
    helm,
    labels_match,
    render,
    value_args,
)
from tests.helm.launch import service_parsers

SCENARIOS = {
    "defaults": (),
    "full": ("values-full.yaml",),
    "gpu": ("values-gpu.yaml",),
    "seeds": ("../../helm/chatmesh/values-seeds-scale.yaml",),  # one cell of docs/operations/capacity.md
    "models": ("values-models.yaml",),  # two models, each on an engine pool of its own
}
FULL = "cm-chatmesh"


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return {name: render(files, REQUIRED_SETS if not files else ()) for name, files in SCENARIOS.items()}


# -- lint and schema -----------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_chart_lints_strict(scenario):
    sets = REQUIRED_SETS if scenario == "defaults" else ()
    out = helm("lint", "--strict", str(CHART), *value_args(SCENARIOS[scenario], sets))
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_objects_pass_kubernetes_validate_strict(rendered, scenario):
    objects = rendered[scenario].objects
    core = [o for o in objects if o["kind"] not in CRD_KINDS]
    assert len(core) > 20
    for version in K8S_VERSIONS:
        for obj in core:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']} {obj['metadata']['name']} (k8s {version}): {exc.message}")


def test_crd_objects_have_their_apis_shape_and_valid_pod_templates(rendered):
    objects = rendered["full"].objects
    crds = [o for o in objects if o["kind"] in CRD_KINDS]
    assert {o["kind"] for o in crds} == set(CRD_KINDS)
    for obj in crds:
        assert obj["apiVersion"] == CRD_KINDS[obj["kind"]]
    # Each ServiceMonitor selects exactly the Service of its component, on a port named `metrics`.
    services = rendered["full"].of_kind("Service")
    for monitor in rendered["full"].of_kind("ServiceMonitor"):
        spec = monitor["spec"]
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        assert [e["port"] for e in spec["endpoints"]] == ["metrics"]
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        matching = [
            s for s in services if labels_match(spec["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert [s["metadata"]["name"] for s in matching] == [monitor["metadata"]["name"]]
        assert "metrics" in {p["name"] for p in matching[0]["spec"]["ports"]}
    assert {m["metadata"]["name"] for m in rendered["full"].of_kind("ServiceMonitor")} == {
        f"{FULL}-{c}" for c in ("orchestrator", "router", "engine", "edge")
    }
    # The LeaderWorkerSet's templates are Pods Kubernetes would accept.
    lws = rendered["full"].get("LeaderWorkerSet", f"{FULL}-engine")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    for role in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", **template[role]}
        pod["metadata"] = {"name": f"lws-{role.lower()}", **template[role]["metadata"]}
        kubernetes_validate.validate(pod, K8S_VERSIONS[0], strict=True)


def test_values_schema_rejects_a_misspelt_key_and_an_unknown_backend():
    with pytest.raises(HelmError, match="backnd"):
        helm("template", "x", str(CHART), *value_args((), (*REQUIRED_SETS, "engine.backnd=cuda")))
    with pytest.raises(HelmError, match="backend"):
        helm("template", "x", str(CHART), *value_args((), (*REQUIRED_SETS, "engine.backend=vllm")))


def test_missing_cassandra_or_jwks_fails_saying_what_to_set():
    with pytest.raises(HelmError, match=r"cassandra\.contactPoints.*bundled\.enabled"):
        render(sets=("envoy.jwt.existingSecret=s",))
    with pytest.raises(HelmError, match=r"envoy\.jwt: set existingSecret"):
        render(sets=("cassandra.contactPoints[0]=c",))


def test_a_hosted_backend_without_a_model_fails_saying_what_to_set():
    with pytest.raises(
        HelmError, match=r"engine\.backend=trtllm serves a Hugging Face directory: set model\.path"
    ):
        render(sets=(*REQUIRED_SETS, "engine.backend=trtllm"))


def test_parallelism_a_backend_cannot_run_fails_at_render_saying_why():
    triton = ("engine.backend=triton", "model.path=m", "model.pvc.claimName=models")
    with pytest.raises(
        HelmError, match=r"tensorParallelSize \(2\) needs engine\.backend cpu, cuda or trtllm"
    ):
        render(sets=(*REQUIRED_SETS, *triton, "engine.tensorParallelSize=2"))
    with pytest.raises(HelmError, match=r"pipelineParallelSize \(2\) needs engine\.backend=trtllm"):
        render(sets=(*REQUIRED_SETS, "engine.backend=cuda", "engine.pipelineParallelSize=2"))
    with pytest.raises(HelmError, match=r"model\.pvc\.claimName: name the PersistentVolumeClaim"):
        render(sets=(*REQUIRED_SETS, "model.path=m"))


def test_multi_node_needs_trtllm_and_an_even_gpu_split():
    base = ("values-full.yaml",)
    with pytest.raises(HelmError, match=r"needs engine\.backend=trtllm"):
        render(base, ("engine.backend=cuda",))
    with pytest.raises(HelmError, match=r"engine\.multiNode\.sshSecret: a Secret with id_ed25519"):
        render(base, ("engine.multiNode.sshSecret=",))
    # values-full has 2 pipeline stages: 3 x 2 = 6 GPUs do not split over 4 nodes.
    with pytest.raises(
        HelmError,
        match=r"tensorParallelSize x pipelineParallelSize \(6\) must divide evenly over .*nodes \(4\)",
    ):
        render(base, ("engine.tensorParallelSize=3", "engine.multiNode.nodes=4"))


# -- probes, flags, discovery --------------------------------------------------------------------


def _port_flag(env: dict[str, str | None], service: str) -> int:
    return int(env[f"CHATMESH_{service.upper()}_PORT"])


@pytest.mark.parametrize("scenario", ["defaults", "full", "models"])
def test_every_probe_hits_the_port_its_service_listens_on(rendered, scenario):
    chart = rendered[scenario]
    probed = set()
    for component, _, spec in chart.pod_specs():
        for container in spec["containers"]:
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            env = env_of(container)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                probed.add(component)
                service = "engine" if component.startswith("engine-") else component  # a model pool's
                if service in ("orchestrator", "router", "engine"):
                    # grpc.health.v1 on the service's own gRPC port (the port its flag sets).
                    assert probe["grpc"]["port"] == ports["grpc"] == _port_flag(env, service)
                    if kind == "readinessProbe":
                        # A busy replica answers late (up to 3.0 s at twice what it relays), not
                        # NOT_SERVING: it stays in its Service.
                        assert probe["timeoutSeconds"] > 3
                elif component == "edge":
                    assert probe["httpGet"]["path"] == "/healthz"
                    assert ports[probe["httpGet"]["port"]] == _port_flag(env, "edge")
                elif component == "envoy":
                    http = probe.get("httpGet") or probe["tcpSocket"]
                    assert ports[http["port"]] == envoy_settings(chart)["listen_port"]
    assert {"orchestrator", "router", "engine", "edge", "envoy"} <= probed


def test_edge_health_path_is_a_route_the_edge_serves():
    from chatmesh.identity import TokenVerifier
    from edge.app import create_app
    from edge.drain import Drain
    from edge.settings import EdgeSettings
    from localmesh.dev_jwt import ISSUER
    from tests.fixtures.identity import session_keys

    verifier = TokenVerifier(session_keys().jwks_path, ISSUER)
    app = create_app(EdgeSettings(orchestrator="127.0.0.1:1"), verifier, Drain())
    assert "/healthz" in {getattr(route, "path", None) for route in app.routes}


def _flag_envs(parse) -> set[str]:
    """Every CHATMESH_* variable a service's real parser reads (from its --help)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(["--help"])
    return set(re.findall(r"\[env\s+(CHATMESH_[A-Z0-9_]+)\]", out.getvalue()))


def _parsers():
    """The services the chart configures through CHATMESH_* variables (memory_store takes arguments)."""
    return {name: parse for name, parse in service_parsers().items() if name != "memory_store"}


@pytest.mark.parametrize("scenario", ["defaults", "full", "gpu", "seeds", "models"])
def test_every_chatmesh_variable_is_a_real_flag_and_the_service_accepts_its_value(
    rendered, scenario, monkeypatch
):
    chart = rendered[scenario]
    for service, parse in _parsers().items():
        env = env_of(chart.container(service, service))
        ours = {name for name in env if name.startswith("CHATMESH_")}
        unknown = ours - _flag_envs(parse)
        assert not unknown, f"{service}: the chart sets variables no flag reads: {sorted(unknown)}"
        # The service parses the chart's values (types, list syntax, cross-flag checks) without error.
        for name in list(os.environ):
            if name.startswith("CHATMESH_"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            if name.startswith("CHATMESH_"):
                monkeypatch.setenv(name, value if value is not None else "from-the-pod")
        args, _ = parse([])  # the service parses and checks the chart's values (exit 2 if it refuses)
        assert args.host == "0.0.0.0"
        assert args.port == _port_flag(env, service)


def test_the_seeds_cell_has_the_shape_of_the_capacity_model(rendered):
    """docs/operations/capacity.md: a cell is 110 engines of block size 64, 35 routers, 52 orchestrators, 35 edges."""
    chart = rendered["seeds"]
    assert chart.get("StatefulSet", f"{FULL}-engine")["spec"]["replicas"] == 110
    assert env_of(chart.container("engine", "engine"))["CHATMESH_ENGINE_BLOCK_SIZE"] == "64"
    replicas = {
        name: chart.get("Deployment", f"{FULL}-{name}")["spec"]["replicas"] for name in ("router", "envoy")
    }
    assert replicas == {"router": 35, "envoy": 7}
    for name, minimum in (("orchestrator", 52), ("edge", 35)):
        assert chart.get("HorizontalPodAutoscaler", f"{FULL}-{name}")["spec"]["minReplicas"] == minimum


def test_user_config_reaches_the_services_as_typed_flags(rendered, monkeypatch):
    """values-full sets a few flags per service; the parsed values are what the values file says."""
    chart = rendered["full"]
    parsers = _parsers()

    def parsed(service):
        for name, value in env_of(chart.container(service, service)).items():
            monkeypatch.setenv(name, value or "pod")
        return parsers[service]([])[0]

    orchestrator = parsed("orchestrator")
    assert orchestrator.budget_free_tokens == 50000
    assert orchestrator.moderation_blocked_term == ["foo", "bar"]
    assert orchestrator.summaries is False
    assert orchestrator.cassandra_apply_schema is False
    # MCP servers (docs/tools.md "MCP servers"), their credentials from the Secret mounted whole.
    assert orchestrator.mcp_server == [
        "search=https://search.tools.internal/mcp",
        "tickets=http://tickets:8080/mcp",
    ]
    assert orchestrator.mcp_credentials_dir == "/etc/chatmesh/mcp"
    pod = chart.get("Deployment", f"{FULL}-orchestrator")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in chart.container("orchestrator", "orchestrator")["volumeMounts"]}
    assert mounts["mcp-credentials"] == {
        "name": "mcp-credentials",
        "mountPath": "/etc/chatmesh/mcp",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["mcp-credentials"]["secret"] == {"secretName": "chatmesh-mcp"}
    assert parsed("router").overlap_weight == 1.0
    assert parsed("edge").max_body_bytes == 2097152
    engine = parsed("engine")
    assert engine.kv_memory_gib == 40.5
    assert engine.backend == "trtllm"


@pytest.mark.parametrize("scenario", ["defaults", "full"])
def test_router_resolves_the_engines_headless_service(rendered, scenario):
    chart = rendered[scenario]
    dns = env_of(chart.container("router", "router"))["CHATMESH_ROUTER_ENGINE_DNS"]
    host, port = dns.rsplit(":", 1)
    service_name, namespace, *_ = host.split(".")
    assert host == f"{service_name}.{NAMESPACE}.svc.cluster.local" and namespace == NAMESPACE
    service = chart.get("Service", service_name)
    assert service["spec"]["clusterIP"] == "None"  # one DNS answer per ready engine
    assert int(port) in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}
    # It selects exactly the pods that serve EngineService (with multi-node TP, only the leaders).
    selected = [
        (component, meta["labels"].get("chatmesh.io/engine-role"))
        for component, meta, _ in chart.pod_specs()
        if labels_match(service["spec"]["selector"], meta["labels"])
    ]
    expected = [("engine", "leader")] if scenario == "full" else [("engine", None)]
    assert selected == expected
    engine = chart.container("engine", "engine")
    assert int(port) == next(p["containerPort"] for p in engine["ports"] if p["name"] == "grpc")


def test_services_point_at_each_other_and_at_cassandra(rendered):
    chart = rendered["full"]
    orchestrator = env_of(chart.container("orchestrator", "orchestrator"))
    # Every router's address (a headless Service): generations spread over them and fail over.
    router = f"{FULL}-router-headless"
    assert (
        orchestrator["CHATMESH_ORCHESTRATOR_ROUTER"] == f"dns:///{router}.{NAMESPACE}.svc.cluster.local:50051"
    )
    assert chart.get("Service", router)["spec"]["clusterIP"] == "None"
    # Every orchestrator's too: the edge keeps a chat on one and spreads its completion links.
    orchestrators = f"{FULL}-orchestrator-headless"
    assert env_of(chart.container("edge", "edge"))["CHATMESH_EDGE_ORCHESTRATOR"] == (
        f"dns:///{orchestrators}.{NAMESPACE}.svc.cluster.local:50050"
    )
    assert chart.get("Service", orchestrators)["spec"]["clusterIP"] == "None"
    # Bundled Cassandra: its Service, one replica in the local DC; the Job creates what replicas read.
    cassandra = f"{FULL}-cassandra.{NAMESPACE}.svc.cluster.local"
    assert orchestrator["CHATMESH_ORCHESTRATOR_CASSANDRA"] == f"{cassandra}:9042"
    assert chart.get("StatefulSet", f"{FULL}-cassandra")["spec"]["replicas"] == 1
    job = chart.get("Job", f"{FULL}-schema-r1")["spec"]["template"]["spec"]["containers"][0]
    assert job["args"][:2] == ["memory_store", "schema"]
    assert _opt(job["args"], "--hosts") == cassandra
    assert _opt(job["args"], "--replication") == orchestrator["CHATMESH_ORCHESTRATOR_CASSANDRA_REPLICATION"]
    assert _opt(job["args"], "--replication") == "NetworkTopologyStrategy:datacenter1=1"


def test_external_cassandra_gets_network_topology_replication_and_one_port(rendered):
    # Default: three replicas in the local datacenter.
    default = env_of(rendered["defaults"].container("orchestrator", "orchestrator"))
    assert default["CHATMESH_ORCHESTRATOR_CASSANDRA_REPLICATION"] == "NetworkTopologyStrategy:datacenter1=3"
    # Set: exactly the datacenters given (not merged with the default), one port for every contact point.
    chart = rendered["gpu"]
    env = env_of(chart.container("orchestrator", "orchestrator"))
    assert env["CHATMESH_ORCHESTRATOR_CASSANDRA"] == "cassandra-dc1-service.k8ssandra:9142,10.0.0.12:9142"
    assert env["CHATMESH_ORCHESTRATOR_CASSANDRA_REPLICATION"] == "NetworkTopologyStrategy:dc1=3,dc2=3"
    assert env["CHATMESH_ORCHESTRATOR_CASSANDRA_LOCAL_DC"] == "dc1"
    assert env["CHATMESH_ORCHESTRATOR_CASSANDRA_APPLY_SCHEMA"] == "false"
    assert not chart.of_kind("StatefulSet") or all(
        component_of(s["spec"]["template"]["metadata"]) != "cassandra" for s in chart.of_kind("StatefulSet")
    )
    # Replicas wait for the schema the Job applies, against the same hosts and keyspace.
    orch_pod = next(spec for c, _, spec in chart.pod_specs() if c == "orchestrator")
    wait = orch_pod["initContainers"][0]
    job = chart.get("Job", f"{FULL}-schema-r1")["spec"]["template"]["spec"]["containers"][0]
    assert "schema --check" in wait["args"][0]
    for option in ("--hosts", "--cql-port", "--keyspace", "--local-dc"):
        assert _opt(wait["args"], option) == _opt(job["args"], option)
    assert _opt(job["args"], "--hosts") == "cassandra-dc1-service.k8ssandra,10.0.0.12"
    assert _opt(job["args"], "--cql-port") == "9142"


def _opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# -- network paths ---------------------------------------------------------------------------------


def _allowed_paths(chart: Rendered) -> set[tuple[str, str, int]]:
    """(caller, callee, port) for every NetworkPolicy rule naming chatmesh pods; '*' = any caller."""
    pod_labels = {component: meta["labels"] for component, meta, _ in chart.pod_specs()}

    def components(selector: dict) -> list[str]:
        return sorted(
            {c for c, labels in pod_labels.items() if labels_match(selector["matchLabels"], labels)}
        )

    paths = set()
    for policy in chart.of_kind("NetworkPolicy"):
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        for callee in components(spec["podSelector"]):
            for rule in spec["ingress"]:
                ports = [p["port"] for p in rule.get("ports", [])] or [0]
                callers = []
                for peer in rule.get("from", [{}]):
                    callers += components(peer["podSelector"]) if "podSelector" in peer else ["*"]
                paths |= {(caller, callee, port) for caller in callers for port in ports}
    return paths


# The mesh's calls: anyone → Envoy → edge → orchestrator → router → engines.
CALL_GRAPH = {
    ("*", "envoy", 8080),
    ("envoy", "edge", 8081),
    ("envoy", "orchestrator", 50050),
    ("edge", "orchestrator", 50050),
    ("orchestrator", "router", 50051),
    ("router", "engine", 50061),
}


def test_network_policies_allow_exactly_the_call_graph(rendered):
    assert _allowed_paths(rendered["defaults"]) == CALL_GRAPH
    assert _allowed_paths(rendered["full"]) == CALL_GRAPH | {
        # Bundled Cassandra: the orchestrators and the schema Job.
        ("orchestrator", "cassandra", 9042),
        ("schema", "cassandra", 9042),
        # Multi-node engines: MPI/NCCL among the group's own pods, on ports they pick.
        ("engine", "engine", 0),
        # Prometheus (networkPolicy.metricsFrom) scrapes the services' metrics ports.
        *{("*", c, 9090) for c in ("edge", "orchestrator", "router", "engine")},
    }
    # Envoy's callers in values-full are networkPolicy.envoyFrom (an ipBlock).
    envoy_policy = rendered["full"].get("NetworkPolicy", f"{FULL}-envoy")
    assert envoy_policy["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]


# -- several models -------------------------------------------------------------------------------

GEMMA = "gemma-3-270m-q4_k_m"
GEMMA_POOL = 'json:extraModels=[{"key": "gemma", "name": "gemma-3-270m-q4_k_m", "path": "g.gguf", "kind": "completion", "licence": "Gemma Terms of Use"}]'


def test_each_model_pool_is_found_by_the_router_and_prompted_with_its_own_file(rendered, monkeypatch):
    chart = rendered["models"]
    # The router resolves every pool's headless Service, each selecting exactly its own pool's engines.
    pools = {}
    for name in env_of(chart.container("router", "router"))["CHATMESH_ROUTER_ENGINE_DNS"].split(","):
        host, port = name.rsplit(":", 1)
        service = chart.get("Service", host.split(".")[0])
        assert service["spec"]["clusterIP"] == "None"
        selected = [
            component
            for component, meta, _ in chart.pod_specs()
            if labels_match(service["spec"]["selector"], meta["labels"])
        ]
        assert len(selected) == 1, selected
        engine = chart.container(selected[0], "engine")
        assert int(port) == next(p["containerPort"] for p in engine["ports"] if p["name"] == "grpc")
        pools[selected[0]] = env_of(engine)
    assert sorted(pools) == ["engine", "engine-gemma"]
    # The first pool serves its file under the file's own name; the other under the name requests give.
    smollm2, gemma = pools["engine"], pools["engine-gemma"]
    assert smollm2["CHATMESH_ENGINE_MODEL"] == "/models/smollm2-135m-instruct.q4_1.gguf"
    assert "CHATMESH_ENGINE_SERVED_MODEL_NAME" not in smollm2
    assert gemma["CHATMESH_ENGINE_MODEL"] == "/models/gemma-3-270m-q4_k_m.gguf"
    assert gemma["CHATMESH_ENGINE_SERVED_MODEL_NAME"] == GEMMA
    # The pool's own engine flags, replicas and resources; the engine parser takes its variables.
    assert gemma["CHATMESH_ENGINE_THREADS"] == "1" and "CHATMESH_ENGINE_THREADS" not in smollm2
    pool_set = chart.get("StatefulSet", f"{FULL}-engine-gemma")
    assert pool_set["spec"]["replicas"] == 1
    assert chart.container("engine-gemma", "engine")["resources"]["limits"] == {"memory": "2Gi"}
    for name in list(os.environ):
        if name.startswith("CHATMESH_"):
            monkeypatch.delenv(name)
    for name, value in gemma.items():
        monkeypatch.setenv(name, value or "pod")
    assert _parsers()["engine"]([])[0].served_model_name == GEMMA
    # Its pods say which model runs there, of which kind, under which licence.
    annotations = pool_set["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "chatmesh.io/model": GEMMA,
        "chatmesh.io/model-kind": "completion",
        "chatmesh.io/model-licence": "Gemma Terms of Use",
    }
    # The orchestrator: one --model-file per pool (the same files, mounted), as its own parser reads them.
    for name, value in env_of(chart.container("orchestrator", "orchestrator")).items():
        monkeypatch.setenv(name, value or "pod")
    files = [ModelFile.parse(flag) for flag in _parsers()["orchestrator"]([])[0].model_file]
    assert [(f.name, str(f.path)) for f in files] == [
        ("", smollm2["CHATMESH_ENGINE_MODEL"]),
        (GEMMA, gemma["CHATMESH_ENGINE_MODEL"]),
    ]
    for component in ("orchestrator", "engine-gemma"):
        mounts = chart.container(component, component.split("-")[0])["volumeMounts"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in mounts


def test_every_model_pool_is_reachable_scraped_alerted_on_and_disrupted_one_at_a_time(rendered):
    chart = rendered["models"]
    assert _allowed_paths(chart) == CALL_GRAPH | {
        ("router", "engine-gemma", 50061),
        *{("*", c, 9090) for c in ("edge", "orchestrator", "router", "engine", "engine-gemma")},
    }
    monitored = {
        m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        for m in chart.of_kind("ServiceMonitor")
    }
    assert {"engine", "engine-gemma"} <= monitored
    assert chart.get("PodDisruptionBudget", f"{FULL}-engine-gemma")["spec"]["maxUnavailable"] == 1
    exprs = [
        r["expr"]
        for g in chart.of_kind("PrometheusRule")[0]["spec"]["groups"]
        for r in g["rules"]
        if "expr" in r
    ]
    kv_cache = next(e for e in exprs if "kv_cache_usage_ratio" in e)
    jobs = re.search(r'job=~"([^"]+)"', kv_cache)
    assert jobs is not None
    assert all(re.fullmatch(jobs[1], f"{FULL}-{c}") for c in ("engine", "engine-gemma"))
    assert not re.fullmatch(jobs[1], f"{FULL}-router")


MINILM = "all-MiniLM-L6-v2"
EMBEDDING_POOL = (
    'json:extraModels=[{"key": "embed", "name": "all-MiniLM-L6-v2", "path": "all-MiniLM-L6-v2", '
    '"kind": "embedding", "licence": "Apache-2.0", "config": {"backend": "cpu", "threads": 2}}]'
)


def test_an_embedding_pool_is_routed_but_not_prompted(monkeypatch):
    chart = render(("values-models.yaml",), (EMBEDDING_POOL,))
    engine = env_of(chart.container("engine-embed", "engine"))
    assert engine["CHATMESH_ENGINE_MODEL"] == "/models/all-MiniLM-L6-v2"
    assert (
        engine["CHATMESH_ENGINE_SERVED_MODEL_NAME"] == MINILM and engine["CHATMESH_ENGINE_BACKEND"] == "cpu"
    )
    dns = env_of(chart.container("router", "router"))["CHATMESH_ROUTER_ENGINE_DNS"]
    assert "engine-embed" in dns
    # The orchestrator builds no prompts for it: only the first pool's file.
    for name in list(os.environ):
        if name.startswith("CHATMESH_"):
            monkeypatch.delenv(name)
    for name, value in env_of(chart.container("orchestrator", "orchestrator")).items():
        monkeypatch.setenv(name, value or "pod")
    files = [ModelFile.parse(flag) for flag in _parsers()["orchestrator"]([])[0].model_file]
    assert [str(f.path) for f in files] == ["/models/smollm2-135m-instruct.q4_1.gguf"]


def test_a_model_pool_needs_the_model_volume_single_node_engines_and_a_known_kind():
    with pytest.raises(HelmError, match=r"extraModels serve files of the model volume.*set model\.path"):
        render(sets=(*REQUIRED_SETS, GEMMA_POOL))
    with pytest.raises(HelmError, match=r"extraModels gemma: .*engine\.multiNode is for the first pool only"):
        render(("values-full.yaml",), (GEMMA_POOL,))
    with pytest.raises(HelmError, match="kind"):
        render(("values-models.yaml",), (GEMMA_POOL.replace("completion", "vision"),))
    with pytest.raises(HelmError, match="key"):
        render(("values-models.yaml",), (GEMMA_POOL.replace('"gemma"', '"Gemma_3"'),))


# -- GPUs, drain, scaling --------------------------------------------------------------------------


def _gpus(container: dict) -> int | None:
    return container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")


def test_engine_gpus_equal_the_tensor_parallel_size(rendered):
    assert _gpus(rendered["defaults"].container("engine", "engine")) is None  # cpu backend
    single = rendered["gpu"]
    engine = single.container("engine", "engine")
    assert _gpus(engine) == 4
    # cuda: one rank per GPU under torchrun, the engine told the same size.
    assert engine["args"] == ["torchrun", "--standalone", "--nproc-per-node", "4", "--module", "engine"]
    assert env_of(engine)["CHATMESH_ENGINE_BACKEND"] == "cuda"
    assert env_of(engine)["CHATMESH_ENGINE_TENSOR_PARALLEL_SIZE"] == "4"
    # Multi-node: TP 4 x PP 2 over 2 nodes is 4 GPUs per pod, and MPI starts 8 ranks, 4 slots per host.
    multi = rendered["full"]
    leader, worker = multi.container("engine", "engine"), multi.container("engine", "worker")
    assert _gpus(leader) == _gpus(worker) == 4
    script = leader["args"][0]
    assert "mpirun --allow-run-as-root -np 8" in script
    assert script.count(":4") == 2
    assert "trtllm-llmapi-launch python -m engine" in script
    # extraArgs are templates over the values.
    assert leader["args"][1:] == ["engine", "--served-model-name", "llama-70b"]
    pod = next(spec for c, meta, spec in multi.pod_specs() if c == "engine")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in leader["volumeMounts"]


def test_sigterm_drain_fits_in_the_termination_grace_period(rendered):
    chart = rendered["full"]
    checked = set()
    pre_stop_sleep = 5
    for component, _, spec in chart.pod_specs():
        if component not in ("orchestrator", "router", "engine", "edge", "envoy"):
            continue
        container = spec["containers"][0]
        if component == "envoy":
            drain = float(container["command"][container["command"].index("--drain-time-s") + 1])
            hook = container["lifecycle"]["preStop"]["exec"]["command"][-1]
            assert f"sleep {pre_stop_sleep + math.ceil(drain)}" in hook and "drain_listeners?graceful" in hook
        elif container["name"] == "worker":
            continue
        else:
            drain = float(env_of(container)[f"CHATMESH_{component.upper()}_DRAIN_GRACE_S"])
            assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop_sleep)]
            # Liveness never kills a draining pod (its health is NOT_SERVING during the drain).
            live = container["livenessProbe"]
            assert live["periodSeconds"] * live["failureThreshold"] > pre_stop_sleep + drain
        # preStop sleep + the drain (and its half-second NOT_SERVING notice) + time to shut down.
        assert spec["terminationGracePeriodSeconds"] >= pre_stop_sleep + drain + 5, component
        checked.add(component)
    assert checked == {"orchestrator", "router", "engine", "edge", "envoy"}


def test_longer_drain_values_lengthen_the_grace_period():
    chart = render(sets=(*REQUIRED_SETS, "orchestrator.drainGraceSeconds=300", "preStopSleepSeconds=10"))
    spec = next(s for c, _, s in chart.pod_specs() if c == "orchestrator")
    assert env_of(spec["containers"][0])["CHATMESH_ORCHESTRATOR_DRAIN_GRACE_S"] == "300"
    assert spec["terminationGracePeriodSeconds"] >= 310


def test_orchestrator_and_edge_autoscale_and_every_service_has_a_disruption_budget(rendered):
    chart = rendered["defaults"]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h["spec"] for h in chart.of_kind("HorizontalPodAutoscaler")}
    assert set(hpas) == {f"{FULL}-orchestrator", f"{FULL}-edge"}
    for name, spec in hpas.items():
        assert "replicas" not in chart.get("Deployment", name)["spec"]  # the HPA owns the count
        assert spec["minReplicas"] >= 2
    pdbs = {p["metadata"]["name"]: p["spec"] for p in chart.of_kind("PodDisruptionBudget")}
    assert set(pdbs) == {f"{FULL}-{c}" for c in ("orchestrator", "router", "engine", "edge", "envoy")}
    assert pdbs[f"{FULL}-orchestrator"]["minAvailable"] == 2
    # With autoscaling off, replicas is the values' number.
    assert rendered["full"].get("Deployment", f"{FULL}-orchestrator")["spec"]["replicas"] == 4


def test_multi_node_engines_are_disrupted_one_group_at_a_time(rendered):
    """One budget over every pod of every group (leaders and workers): an evicted pod takes its group
    down, whose pods then count as unavailable, so no other eviction is allowed until that group is back.
    (A budget per group index would let a drain take one pod of every group at once.)"""
    chart = rendered["full"]
    budget = chart.get("PodDisruptionBudget", f"{FULL}-engine")["spec"]
    assert budget["maxUnavailable"] == 1
    selected = [
        meta["labels"].get("chatmesh.io/engine-role")
        for _, meta, _ in chart.pod_specs()
        if labels_match(budget["selector"]["matchLabels"], meta["labels"])
    ]
    assert selected == ["leader", "worker"]


# -- Envoy ---------------------------------------------------------------------------------------


def envoy_settings(chart: Rendered) -> dict:
    return json.loads(chart.get("ConfigMap", f"{FULL}-envoy")["data"]["settings.json"])


@pytest.mark.parametrize("scenario", ["defaults", "full"])
def test_envoy_config_renders_from_the_chart_settings_and_envoy_accepts_it(rendered, scenario, tmp_path):
    settings = envoy_settings(rendered[scenario])
    # The JWKS the pod mounts from the Secret; here, a real one.
    pod = next(spec for c, _, spec in rendered[scenario].pod_specs() if c == "envoy")
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert settings["jwks_path"] == f"{mounts['jwks']}/jwks.json"
    settings["jwks_path"] = str(generate_keys(tmp_path / "keys").jwks_path)
    config = EnvoyConfig.from_dict(settings)
    path = write_config(config, tmp_path / "envoy.yaml", check=True)  # envoy --mode validate
    bootstrap = yaml.safe_load(path.read_text())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    # Upstreams are the headless Services, resolved by DNS (every ready pod is a host).
    orchestrator = clusters["orchestrator"]
    assert orchestrator["type"] == "STRICT_DNS" and orchestrator["lb_policy"] == "RING_HASH"
    address = orchestrator["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {
        "address": f"{FULL}-orchestrator-headless.{NAMESPACE}.svc.cluster.local",
        "port_value": 50050,
    }
    assert rendered[scenario].get("Service", f"{FULL}-orchestrator-headless")["spec"]["clusterIP"] == "None"
    assert clusters["edge"]["type"] == "STRICT_DNS"
    assert ("otel_collector" in clusters) == (scenario == "full")
    # Same routes as the local mesh: one per ChatService RPC, plus the edge's.
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8080}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    grpc_paths = {r["match"].get("path") for r in routes if "path" in r["match"]}
    assert grpc_paths == {m.path for m in chat_service_methods()}
    jwt = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.jwt_authn")
    provider = jwt["typed_config"]["providers"]["chatmesh"]
    assert provider["issuer"] == "chatmesh-dev" and provider["audiences"] == ["chatmesh"]


def test_envoy_rate_limits_and_cors_come_from_values(tmp_path):
    chart = render(
        sets=(
            "cassandra.contactPoints[0]=c",
            "envoy.rateLimits.generate.free.burst=3",
            "envoy.corsOrigins[0]=https://chat.example.com",
            'json:envoy.jwt.jwks="{\\"keys\\": []}"',
        )
    )
    settings = envoy_settings(chart)
    assert settings["rate_limits"]["generate"]["tiers"]["free"] == {
        "burst": 3,
        "refill": 1,
        "fill_interval_s": 6,
    }
    settings["jwks_path"] = str(tmp_path / "jwks.json")
    text = Path(write_config(EnvoyConfig.from_dict(settings), tmp_path / "e.yaml", check=False)).read_text()
    assert "token_bucket: {max_tokens: 3, tokens_per_fill: 1, fill_interval: 6s}" in text
    # A gRPC call the generate limit refuses: RESOURCE_EXHAUSTED with a RetryInfo of the values' longest
    # refill interval (free: every 6 s), as the orchestrator's own limits answer.
    routes = yaml.safe_load(text)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes = routes["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    send = next(r for r in routes if r["match"].get("path") == "/chatmesh.chat.v1.ChatService/SendMessage")
    limit = send["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]
    assert limit["rate_limited_as_resource_exhausted"] is True
    headers = {h["header"]["key"]: h["header"]["value"] for h in limit["response_headers_to_add"]}
    refusal = errors.from_status(base64.b64decode(headers["grpc-status-details-bin"]))
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.retry_after_s == 6
    assert headers["retry-after"] == "6"
    assert '- exact: "https://chat.example.com"' in text
    # existingSecret unset: the chart makes the Secret from the inline JWKS.
    secret = chart.get("Secret", f"{FULL}-envoy-jwks")
    assert json.loads(secret["stringData"]["jwks.json"]) == {"keys": []}


def test_release_name_containing_chatmesh_is_not_repeated():
    out = helm("template", "chatmesh", str(CHART), *value_args((), REQUIRED_SETS))
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(out) if d}
    assert "chatmesh-router" in names
    assert RELEASE not in {n.split("-")[0] for n in names}


@pytest.mark.parametrize("scenario", ["defaults", "full"])
def test_edge_and_orchestrator_verify_tokens_with_envoys_jwks(rendered, scenario):
    """Identity cannot be forged behind Envoy: the services that serve users mount the same JWKS Secret
    and check the same issuer and audience as Envoy, so a direct call needs a token Envoy would accept."""
    chart = rendered[scenario]
    settings = envoy_settings(chart)
    secrets = {}
    for component, _, spec in chart.pod_specs():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        if "jwks" in volumes:
            secrets[component] = volumes["jwks"]["secret"]["secretName"]
    assert secrets["edge"] == secrets["orchestrator"] == secrets["envoy"]
    for component in ("edge", "orchestrator"):
        container = chart.container(component, component)
        env = env_of(container)
        prefix = f"CHATMESH_{component.upper()}"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "jwks")
        assert mount["readOnly"] and env[f"{prefix}_JWKS_FILE"] == f"{mount['mountPath']}/jwks.json"
        assert env[f"{prefix}_JWT_ISSUER"] == settings["jwt_issuer"]
        assert env[f"{prefix}_JWT_AUDIENCE"] == settings["jwt_audience"]


SIGN_IN_SETS = (
    "cassandra.contactPoints[0]=c",
    "envoy.jwt.issuer=https://idp.example.com/",
    "envoy.signIn.enabled=true",
    "envoy.signIn.clientId=chatmesh-web",
    "envoy.signIn.authorizationEndpoint=https://idp.example.com/authorize",
    "envoy.signIn.tokenEndpoint=https://idp.example.com/oauth/token",
    "envoy.signIn.jwksUri=https://keys.idp.example.com/jwks.json",
    "envoy.signIn.endSessionEndpoint=https://idp.example.com/logout",
    "envoy.signIn.redirectUri=https://chat.example.com/oauth2/callback",
    "envoy.signIn.existingSecret=chatmesh-sign-in",
)


def test_sign_in_values_give_envoy_the_oauth2_filter_and_the_services_the_providers_keys(tmp_path):
    chart = render(sets=SIGN_IN_SETS)
    settings = envoy_settings(chart)
    pod = next(spec for c, _, spec in chart.pod_specs() if c == "envoy")
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The client secret and the cookie key come from the Secret, mounted where the settings point.
    container = pod["containers"][0]
    for key in ("client_secret_path", "hmac_secret_path"):
        assert _mounted(container, volumes, settings["sign_in"][key])["secretName"] == "chatmesh-sign-in"
    assert "jwks" not in volumes and settings["jwks_path"] is None
    assert chart.of_kind("Secret") == []  # no secret comes from values
    for key in ("client_secret_path", "hmac_secret_path"):
        path = tmp_path / Path(settings["sign_in"][key]).name
        path.write_text("not-a-real-secret")
        settings["sign_in"][key] = str(path)
    path = write_config(EnvoyConfig.from_dict(settings), tmp_path / "envoy.yaml", check=True)
    bootstrap = yaml.safe_load(path.read_text())
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    oauth2 = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.oauth2")["typed_config"]
    assert oauth2["config"]["redirect_uri"] == "https://chat.example.com/oauth2/callback"
    assert oauth2["config"]["redirect_path_matcher"] == {"path": {"exact": "/oauth2/callback"}}
    jwt = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.jwt_authn")
    provider = jwt["typed_config"]["providers"]["chatmesh"]
    assert provider["issuer"] == "https://idp.example.com/"
    assert provider["remote_jwks"]["http_uri"]["uri"] == "https://keys.idp.example.com/jwks.json"
    # One TLS cluster per provider host, checking its certificate's name.
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    tls = [c["transport_socket"]["typed_config"]["sni"] for c in clusters.values() if "transport_socket" in c]
    assert sorted(tls) == ["idp.example.com", "keys.idp.example.com"]
    for component in ("edge", "orchestrator"):
        container = chart.container(component, component)
        env = env_of(container)
        prefix = f"CHATMESH_{component.upper()}"
        assert env[f"{prefix}_JWKS_URL"] == "https://keys.idp.example.com/jwks.json"
        assert f"{prefix}_JWKS_FILE" not in env
        assert env[f"{prefix}_JWT_ISSUER"] == "https://idp.example.com/"
        assert not any(m["name"] == "jwks" for m in container["volumeMounts"])


def test_sign_in_without_a_required_value_fails_saying_which():
    sets = tuple(s for s in SIGN_IN_SETS if not s.startswith("envoy.signIn.redirectUri"))
    with pytest.raises(HelmError, match=r"envoy\.signIn\.redirectUri is required"):
        render(sets=sets)


def _mounted(container: dict, volumes: dict[str, dict], path: str) -> dict:
    """The Secret volume ``path`` lies in (through ``container``'s mounts)."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"]
    return volumes[mount["name"]]["secret"]


def test_cassandra_credentials_and_tls_come_from_secrets_for_everything_that_connects(rendered, monkeypatch):
    """The seeds cell logs in to its Cassandra over TLS with a client certificate: the orchestrator, its
    wait-for-schema init container and the schema Job each get the username from the auth Secret, the
    password as a file from it, and the CA and client certificate as files from the TLS Secret; the
    settings parse as memory_store's own flags."""
    from memory_store.__main__ import parse_args as memory_store_args
    from memory_store.security import CassandraSecurity
    from meshkit.config import from_flags
    from orchestrator.config import parse as orchestrator_args

    chart = rendered["seeds"]
    checked = []
    for _, _, spec in chart.pod_specs():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            env = {item["name"]: item for item in container.get("env", [])}
            users = [name for name in env if name.endswith("_CASSANDRA_USERNAME")]
            if not users:
                continue
            prefix = users[0].removesuffix("_USERNAME")
            assert env[users[0]]["valueFrom"]["secretKeyRef"] == {
                "name": "chatmesh-cassandra-auth",
                "key": "username",
            }
            password = env[f"{prefix}_PASSWORD_FILE"]["value"]
            assert _mounted(container, volumes, password)["secretName"] == "chatmesh-cassandra-auth"
            for name in ("TLS_CA_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE"):
                path = env[f"{prefix}_{name}"]["value"]
                assert _mounted(container, volumes, path)["secretName"] == "chatmesh-cassandra-tls"
            for name in list(os.environ):
                if name.startswith("CHATMESH_"):
                    monkeypatch.delenv(name)
            for name, item in env.items():
                monkeypatch.setenv(name, item.get("value", "from-the-secret"))
            if prefix.startswith("CHATMESH_ORCHESTRATOR"):
                security = orchestrator_args([])[1].store.security
            else:
                security = from_flags(CassandraSecurity, memory_store_args(["schema"]))
            assert security.username and security.password_file and security.tls_cert_file
            checked.append(container["name"])
    assert sorted(checked) == ["orchestrator", "schema", "wait-for-schema"]
    # A dev install (bundled node, no Secrets) sets none of it.
    assert not any(
        "CASSANDRA_USERNAME" in name for name in env_of(rendered["full"].container("orchestrator"))
    )
