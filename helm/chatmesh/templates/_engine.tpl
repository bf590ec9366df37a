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
{{- if .gpu }}
# NCCL and MPI exchange through shared memory; the container default (64 MiB) is far too small.
- name: shm
  emptyDir: {medium: Memory, sizeLimit: {{ .root.Values.engine.shmSize }}}
{{- end }}
{{- end -}}
{{- define "chatmesh.engineMounts" -}}
volumeMounts:
{{ include "chatmesh.tmpMount" .root }}
{{- if .gpu }}
- {name: shm, mountPath: /dev/shm}
{{- end }}
{{- end -}}
