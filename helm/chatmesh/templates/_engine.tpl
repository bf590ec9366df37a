{{/* The pieces of an engine pod both the StatefulSet and the LeaderWorkerSet's leader use:
(dict "root" $ "wiring" <flags> "resources" <with GPUs> "gpu" "true"|"") */}}
{{- define "chatmesh.engineContainerCommon" -}}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
env:
{{ include "chatmesh.serviceEnv" (dict "root" .root "service" "engine" "wiring" .wiring "values" .root.Values.engine) }}
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
