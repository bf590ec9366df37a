{{/* The pieces of an engine pod both the StatefulSet and the LeaderWorkerSet's leader use:
(dict "root" $ "wiring" <flags> "resources" <with GPUs> "gpu" "true"|"" ["config" <engine flags>]);
``config`` (a model pool's) defaults to engine.config. */}}
{{- define "chatmesh.engineContainerCommon" -}}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
env:
{{ include "chatmesh.serviceEnv" (dict "root" .root "service" "engine" "wiring" .wiring "values" (dict "config" (.config | default .root.Values.engine.config))) }}
# The engine id is the pod's name (stable in a StatefulSet): logs, metrics and `routed` frames agree.
- name: CHATMESH_ENGINE_ENGINE_ID
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
ports:
- {name: grpc, containerPort: {{ .root.Values.engine.port }}, protocol: TCP}
- {name: metrics, containerPort: {{ .root.Values.metrics.port }}, protocol: TCP}
{{ include "chatmesh.grpcProbes" (dict "root" .root "port" .root.Values.engine.port "startupSeconds" .root.Values.engine.startupSeconds "drain" .root.Values.engine.drainGraceSeconds) }}
lifecycle:
  {{- include "chatmesh.preStop" .root | nindent 2 }}
resources:
  {{- toYaml .resources | nindent 2 }}
{{- end -}}
{{- define "chatmesh.engineVolumes" -}}
volumes:
{{ include "chatmesh.tmpVolume" .root }}
{{- include "chatmesh.modelVolume" .root }}
{{- if .root.Values.engine.multiNode.enabled }}
# MPI's SSH from the leader to the group's workers: the leader's client key, the key the workers accept,
# the workers' host key. Group-readable (fsGroup): ssh and sshd refuse keys others can read only when
# the file is their user's own.
- name: ssh
  secret:
    secretName: {{ required "engine.multiNode.sshSecret: a Secret with id_ed25519, authorized_keys and ssh_host_ed25519_key (docs/deploy/kubernetes.md)" .root.Values.engine.multiNode.sshSecret | quote }}
    defaultMode: 0440
{{- end }}
{{- if .gpu }}
# NCCL and MPI exchange through shared memory; the container default (64 MiB) is far too small.
- name: shm
  emptyDir: {medium: Memory, sizeLimit: {{ .root.Values.engine.shmSize }}}
{{- end }}
{{- end -}}
{{- define "chatmesh.engineMounts" -}}
volumeMounts:
{{ include "chatmesh.tmpMount" .root }}
{{- include "chatmesh.modelMount" .root }}
{{- if .root.Values.engine.multiNode.enabled }}
- {name: ssh, mountPath: /etc/chatmesh/ssh, readOnly: true}
{{- end }}
{{- if .gpu }}
- {name: shm, mountPath: /dev/shm}
{{- end }}
{{- end -}}

{{/* Ranks of one engine: tensor x pipeline parallel. */}}
{{- define "chatmesh.engineWorld" -}}
{{- mul (int .Values.engine.tensorParallelSize) (int .Values.engine.pipelineParallelSize) -}}
{{- end -}}

{{/*
The engine container's arguments on one node (the image's entrypoint runs `engine` as `python -m engine`
and anything else as given): one process, or the launcher its backend needs for several ranks. cuda: one
rank per GPU under torchrun (the engine checks WORLD_SIZE against its --tensor-parallel-size). trtllm:
TensorRT-LLM's LLM API spawns its own MPI workers on one node; NVIDIA's advice for containers is to start
the process as an MPI singleton, `mpirun -n 1`, which the spawn then extends. mpirun passes SIGTERM on
and kills what is left after odls_base_sigkill_timeout: the drain's whole grace period, not its default
second. (dict "root" $ "args" <engine flags>)
*/}}
{{- define "chatmesh.engineLaunch" -}}
{{- $v := .root.Values.engine -}}
{{- $world := include "chatmesh.engineWorld" .root | int -}}
{{- if and (gt (int $v.pipelineParallelSize) 1) (ne $v.backend "trtllm") -}}
{{- fail (printf "engine.pipelineParallelSize (%d) needs engine.backend=trtllm" (int $v.pipelineParallelSize)) -}}
{{- end -}}
{{- if and (gt (int $v.tensorParallelSize) 1) (not (has $v.backend (list "cpu" "cuda" "trtllm"))) -}}
{{- fail (printf "engine.tensorParallelSize (%d) needs engine.backend cpu, cuda or trtllm (%s runs no tensor parallelism)" (int $v.tensorParallelSize) $v.backend) -}}
{{- end -}}
{{- if and (eq $v.backend "cuda") (gt $world 1) -}}
{{- toJson (concat (list "torchrun" "--standalone" "--nproc-per-node" (toString $world) "--module" "engine") .args) -}}
{{- else if and (eq $v.backend "trtllm") (gt $world 1) -}}
{{- toJson (concat (list "mpirun" "-n" "1" "--oversubscribe" "--allow-run-as-root" "--mca" "odls_base_sigkill_timeout" (include "chatmesh.terminationGrace" (dict "root" .root "drain" $v.drainGraceSeconds)) "python" "-m" "engine") .args) -}}
{{- else -}}
{{- toJson (concat (list "engine") .args) -}}
{{- end -}}
{{- end -}}

{{/*
One pool of single-node engines: a StatefulSet (stable pod names are the engine ids) whose ready pods the
router finds through the pool's headless Service. (dict "root" $ "component" "engine[-<pool>]" "replicas"
<n, or nil when autoscaled> "image" <ref> "args" <engine flags> "common" <engineContainerCommon's dict>
"annotations" <pod annotations>)
*/}}
{{- define "chatmesh.engineStatefulSet" -}}
{{- $c := dict "root" .root "component" .component "annotations" .annotations -}}
{{- $root := .root -}}
{{- $v := .root.Values.engine -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ include "chatmesh.component" $c }}
  labels:
    {{- include "chatmesh.labels" $c | nindent 4 }}
spec:
  serviceName: {{ include "chatmesh.component" $c }}
  {{- if not (kindIs "invalid" .replicas) }}
  replicas: {{ .replicas }}
  {{- end }}
  # Engines are independent replicas: start and replace them in parallel.
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "chatmesh.selectorLabels" $c | nindent 6 }}
  template:
    metadata:
      {{- include "chatmesh.podMetadata" $c | nindent 6 }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      # No chatmesh service talks to the Kubernetes API.
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ include "chatmesh.terminationGrace" (dict "root" $root "drain" $v.drainGraceSeconds) }}
      {{- with include "chatmesh.modelInit" (dict "root" $root "weights" true) }}
      initContainers:
      {{- . | trim | nindent 6 }}
      {{- end }}
      containers:
      - name: engine
        image: {{ .image }}
        args: {{ include "chatmesh.engineLaunch" (dict "root" $root "args" .args) }}
        {{- include "chatmesh.engineContainerCommon" .common | nindent 8 }}
        {{- include "chatmesh.containerSecurity" $root | nindent 8 }}
        {{- include "chatmesh.engineMounts" .common | nindent 8 }}
      {{- include "chatmesh.engineVolumes" .common | nindent 6 }}
      {{- include "chatmesh.scheduling" $v | nindent 6 }}
{{- end -}}

{{/* An engine pool's headless Service: one address per ready engine (leader), which the router re-resolves
(--engine-dns). (dict "root" $ "component" "engine[-<pool>]" "leaders" true|false) */}}
{{- define "chatmesh.engineService" -}}
{{- $c := dict "root" .root "component" .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "chatmesh.component" $c }}
  labels:
    {{- include "chatmesh.labels" $c | nindent 4 }}
    # ServiceMonitors select the Services that expose metrics by this label.
    chatmesh.io/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "chatmesh.selectorLabels" $c | nindent 4 }}
    {{- if .leaders }}
    chatmesh.io/engine-role: leader
    {{- end }}
  ports:
  - {name: grpc, port: {{ .root.Values.engine.port }}, targetPort: grpc, protocol: TCP, appProtocol: grpc}
  - {name: metrics, port: {{ .root.Values.metrics.port }}, targetPort: metrics, protocol: TCP}
{{- end -}}

{{/* An engine pod's resources: ``resources`` with the GPUs its backend needs added. (dict "root" $
"resources" <requests and limits>), as JSON */}}
{{- define "chatmesh.engineResources" -}}
{{- $v := .root.Values.engine -}}
{{- $resources := deepCopy .resources -}}
{{- if include "chatmesh.engineUsesGpus" .root -}}
{{- $limits := get $resources "limits" | default dict -}}
{{- $_ := set $limits $v.gpuResourceName (include "chatmesh.gpusPerPod" .root | int) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toJson $resources -}}
{{- end -}}

{{- define "chatmesh.engineImage" -}}
{{- $v := .Values.engine -}}
{{- printf "%s:%s" (default .Values.image.repository $v.image.repository) (default (default .Chart.AppVersion .Values.image.tag) $v.image.tag) -}}
{{- end -}}

{{/* An engine's flags from the chart, for a model file (empty: the bundled model) and, for a pool of
extraModels, the name it serves the model under. (dict "root" $ "model" <path> ["name" <served name>]), as
JSON */}}
{{- define "chatmesh.engineWiring" -}}
{{- $v := .root.Values.engine -}}
{{- $wiring := dict "port" $v.port "drain-grace-s" $v.drainGraceSeconds "backend" $v.backend "tensor-parallel-size" $v.tensorParallelSize "pipeline-parallel-size" $v.pipelineParallelSize -}}
{{- with .model }}
{{- $_ := set $wiring "model" . -}}
{{- end }}
{{- with .name }}
{{- $_ := set $wiring "served-model-name" . -}}
{{- end }}
{{- toJson $wiring -}}
{{- end -}}

{{/* The path of an extraModels entry in the model volume, as the services are given it. */}}
{{- define "chatmesh.poolFile" -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.model.mountPath) (trimSuffix "/" .pool.path) -}}
{{- end -}}

{{/* Every engine pool's component: "engine" (the first pool, model) and "engine-<key>" per extraModels. */}}
{{- define "chatmesh.engineComponents" -}}
{{- $components := list "engine" -}}
{{- range .Values.extraModels -}}
{{- $components = append $components (printf "engine-%s" .key) -}}
{{- end -}}
{{- toJson $components -}}
{{- end -}}
