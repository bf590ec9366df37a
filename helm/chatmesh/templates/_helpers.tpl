{{/* Names: <release>-chatmesh unless the release name already says chatmesh. */}}
{{- define "chatmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "chatmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: (dict "root" $ "component" "router") */}}
{{- define "chatmesh.component" -}}
{{- printf "%s-%s" (include "chatmesh.fullname" .root) .component -}}
{{- end -}}

{{- define "chatmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "chatmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "chatmesh.labels" -}}
{{ include "chatmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Pod template metadata of a component: (dict "root" $ "component" "x" ["annotations" (dict ...)]) */}}
{{- define "chatmesh.podMetadata" -}}
labels:
  {{- include "chatmesh.labels" . | nindent 2 }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with merge (dict) (.annotations | default dict) .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "chatmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* In-cluster DNS name of a component's Service. */}}
{{- define "chatmesh.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "chatmesh.component" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/*
A flag value as its environment variable spells it: booleans true/false, lists comma-joined, and whole
numbers without YAML's float formatting (2097152, not 2.097152e+06).
*/}}
{{- define "chatmesh.flagValue" -}}
{{- if kindIs "slice" . -}}
{{- join "," . -}}
{{- else if kindIs "float64" . -}}
{{- if eq . (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/*
CHATMESH_<SERVICE>_<FLAG> variables: (dict "service" "router" "flags" (dict "port" 50051 ...)).
The services read these as their flags' defaults (meshkit/config.py).
*/}}
{{- define "chatmesh.flagEnv" -}}
{{- $service := .service -}}
{{- range $flag, $value := .flags }}
- name: {{ printf "CHATMESH_%s_%s" $service $flag | upper | replace "-" "_" }}
  value: {{ include "chatmesh.flagValue" $value | quote }}
{{- end }}
{{- end -}}

{{/* The chart's wiring for a service, then the user's `config` (the wiring wins). */}}
{{- define "chatmesh.serviceEnv" -}}
{{- $flags := merge (dict "host" "0.0.0.0" "metrics-port" .root.Values.metrics.port) .wiring (.values.config | default dict) -}}
{{- printf "%s\n%s" (include "chatmesh.flagEnv" (dict "service" .service "flags" $flags) | trim) (include "chatmesh.commonEnv" .root | trim) -}}
{{- end -}}

{{/*
Where spans go: otel.endpoint, else the release's own collector when it runs one (otel.collector.deploy),
else nowhere (empty).
*/}}
{{- define "chatmesh.otelEndpoint" -}}
{{- if .Values.otel.endpoint -}}
{{- .Values.otel.endpoint -}}
{{- else if and .Values.otel.collector.enabled .Values.otel.collector.deploy -}}
{{- printf "http://%s:4317" (include "chatmesh.serviceHost" (dict "root" . "component" "otel-collector")) -}}
{{- end -}}
{{- end -}}

{{/* Environment every chatmesh container gets. */}}
{{- define "chatmesh.commonEnv" }}
- name: HOME
  value: /tmp
{{- with include "chatmesh.otelEndpoint" . }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
Seconds Kubernetes waits after deciding to stop a pod: the preStop sleep, the service's own drain
(drainGraceSeconds, plus the half second its health shows NOT_SERVING first), and a margin for its
shutdown (orchestrator: storing interrupted runs). (dict "root" $ "drain" 30)
*/}}
{{- define "chatmesh.terminationGrace" -}}
{{- add .root.Values.preStopSleepSeconds (ceil .drain | int) 10 -}}
{{- end -}}

{{/* The preStop hook: keep serving while endpoints (and Envoy's DNS view) drop this pod. */}}
{{- define "chatmesh.preStop" -}}
preStop:
  exec:
    command: ["sleep", {{ .Values.preStopSleepSeconds | quote }}]
{{- end -}}

{{/*
gRPC health probes (grpc.health.v1, which every chatmesh server serves; k8s >= 1.27). Health turns
NOT_SERVING when the server drains, so readiness drops the pod at once; liveness tolerates a whole drain
before acting. (dict "root" $ "port" 50050 "startupSeconds" 120 "drain" 30)
*/}}
{{- define "chatmesh.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 2
  failureThreshold: {{ div .startupSeconds 2 }}
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  # A busy replica answers late (2.5-3.0 s at twice what a replica relays, measured), not NOT_SERVING,
  # which a draining one answers at once: the 1 s default would take it out of its Service and move
  # its load onto the others.
  timeoutSeconds: 5
  failureThreshold: 1
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ add (div (add .root.Values.preStopSleepSeconds (ceil .drain | int)) 10) 3 }}
{{- end -}}

{{- define "chatmesh.containerSecurity" -}}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{/*
The JWKS Envoy verifies tokens with (envoy.jwt): the edge and the orchestrator mount the same Secret and
verify each caller's forwarded token themselves, so identity cannot be forged by reaching them directly.
A Secret volume (no subPath) follows the Secret's updates; the services re-read the file when it changes.
*/}}
{{- define "chatmesh.jwksSecret" -}}
{{- default (printf "%s-jwks" (include "chatmesh.component" (dict "root" . "component" "envoy"))) .Values.envoy.jwt.existingSecret -}}
{{- end -}}
{{- define "chatmesh.jwksVolume" -}}
{{- if not .Values.envoy.signIn.enabled }}
- name: jwks
  secret:
    secretName: {{ include "chatmesh.jwksSecret" . }}
    items: [{key: jwks.json, path: jwks.json}]
{{- end }}
{{- end -}}
{{- define "chatmesh.jwksMount" -}}
{{- if not .Values.envoy.signIn.enabled }}
- {name: jwks, mountPath: /etc/chatmesh/jwks, readOnly: true}
{{- end }}
{{- end -}}
{{/* The identity flags of a service that verifies callers' tokens (chatmesh.identity.IdentityConfig): with
envoy.signIn, the identity provider's published keys instead of the JWKS Secret. */}}
{{- define "chatmesh.identityWiring" -}}
{{- $keys := dict "jwks-file" "/etc/chatmesh/jwks/jwks.json" -}}
{{- if .Values.envoy.signIn.enabled }}{{ $keys = dict "jwks-url" .Values.envoy.signIn.jwksUri }}{{ end -}}
{{- toJson (merge $keys (dict "jwt-issuer" .Values.envoy.jwt.issuer "jwt-audience" .Values.envoy.jwt.audience)) -}}
{{- end -}}

{{/*
Cassandra credentials (PasswordAuthenticator) and client TLS from Secrets (cassandra.auth, cassandra.tls),
as the environment of a process that connects (memory_store.security.CassandraSecurity's flags):
(dict "root" $ "service" "orchestrator") or "memory_store" for `python -m memory_store schema`.
*/}}
{{- define "chatmesh.cassandraSecurityEnv" -}}
{{- $c := .root.Values.cassandra -}}
{{- $prefix := printf "CHATMESH_%s_CASSANDRA" (upper .service) -}}
{{- with $c.auth.existingSecret }}
- name: {{ $prefix }}_USERNAME
  valueFrom:
    secretKeyRef: {name: {{ . | quote }}, key: username}
- name: {{ $prefix }}_PASSWORD_FILE
  value: /etc/chatmesh/cassandra-auth/password
{{- end }}
{{- if $c.tls.enabled }}
- name: {{ $prefix }}_TLS_CA_FILE
  value: /etc/chatmesh/cassandra-tls/ca.crt
{{- if $c.tls.clientCertificate }}
- name: {{ $prefix }}_TLS_CERT_FILE
  value: /etc/chatmesh/cassandra-tls/tls.crt
- name: {{ $prefix }}_TLS_KEY_FILE
  value: /etc/chatmesh/cassandra-tls/tls.key
{{- end }}
{{- end }}
{{- end -}}
{{- define "chatmesh.cassandraSecurityVolumes" -}}
{{- $c := .Values.cassandra -}}
{{- with $c.auth.existingSecret }}
- name: cassandra-auth
  secret:
    secretName: {{ . | quote }}
    items: [{key: password, path: password}]
{{- end }}
{{- if $c.tls.enabled }}
- name: cassandra-tls
  secret:
    secretName: {{ required "cassandra.tls.existingSecret: name the Secret holding ca.crt (and tls.crt, tls.key with clientCertificate)" $c.tls.existingSecret | quote }}
{{- end }}
{{- end -}}
{{- define "chatmesh.cassandraSecurityMounts" -}}
{{- if .Values.cassandra.auth.existingSecret }}
- {name: cassandra-auth, mountPath: /etc/chatmesh/cassandra-auth, readOnly: true}
{{- end }}
{{- if .Values.cassandra.tls.enabled }}
- {name: cassandra-tls, mountPath: /etc/chatmesh/cassandra-tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* A writable /tmp (the root filesystem is read-only). */}}
{{- define "chatmesh.tmpVolume" -}}
- name: tmp
  emptyDir: {}
{{- end -}}
{{- define "chatmesh.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* Scheduling fields of a component's pods: (the component's values) */}}
{{- define "chatmesh.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Cassandra: contact points, and the flags memory_store reads. */}}
{{- define "chatmesh.cassandraContactPoints" -}}
{{- if .Values.cassandra.bundled.enabled -}}
{{- printf "%s:%v" (include "chatmesh.serviceHost" (dict "root" . "component" "cassandra")) .Values.cassandra.port -}}
{{- else -}}
{{- $port := .Values.cassandra.port -}}
{{- $points := list -}}
{{- if not .Values.cassandra.contactPoints -}}
{{- fail "cassandra.contactPoints: list the external Cassandra cluster's contact points, or set cassandra.bundled.enabled=true for a development node" -}}
{{- end -}}
{{- range .Values.cassandra.contactPoints -}}
{{- $points = append $points (ternary . (printf "%s:%v" . $port) (contains ":" .)) -}}
{{- end -}}
{{- join "," $points -}}
{{- end -}}
{{- end -}}

{{- define "chatmesh.cassandraReplication" -}}
{{- if .Values.cassandra.bundled.enabled -}}
{{- printf "NetworkTopologyStrategy:%s=1" .Values.cassandra.localDc -}}
{{- else -}}
{{- $dcs := list -}}
{{- range $dc, $rf := .Values.cassandra.replication | default (dict .Values.cassandra.localDc 3) -}}
{{- $dcs = append $dcs (printf "%s=%d" $dc (int $rf)) -}}
{{- end -}}
{{- printf "NetworkTopologyStrategy:%s" (join "," $dcs) -}}
{{- end -}}
{{- end -}}

{{/* Hosts (without ports) and the port, as `python -m memory_store schema` takes them. */}}
{{- define "chatmesh.schemaArgs" -}}
{{- $hosts := list -}}
{{- range splitList "," (include "chatmesh.cassandraContactPoints" .) -}}
{{- $hosts = append $hosts (regexReplaceAll ":[0-9]+$" . "") -}}
{{- end -}}
- --hosts
- {{ join "," $hosts | quote }}
- --cql-port
- {{ .Values.cassandra.port | quote }}
- --keyspace
- {{ .Values.cassandra.keyspace | quote }}
- --local-dc
- {{ .Values.cassandra.localDc | quote }}
{{- end -}}

{{/* GPU backends run on the engine pod's own GPUs (triton talks to a Triton server elsewhere). */}}
{{- define "chatmesh.engineUsesGpus" -}}
{{- if has .Values.engine.backend (list "cuda" "trtllm") }}true{{ end -}}
{{- end -}}

{{/* GPUs per engine pod: the engine's ranks (tensor x pipeline parallel), split evenly over the nodes of a
multi-node group. */}}
{{- define "chatmesh.gpusPerPod" -}}
{{- $world := include "chatmesh.engineWorld" . | int -}}
{{- if .Values.engine.multiNode.enabled -}}
{{- $nodes := int .Values.engine.multiNode.nodes -}}
{{- if ne (mod $world $nodes) 0 -}}
{{- fail (printf "engine.tensorParallelSize x pipelineParallelSize (%d) must divide evenly over engine.multiNode.nodes (%d)" $world $nodes) -}}
{{- end -}}
{{- div $world $nodes -}}
{{- else -}}
{{- $world -}}
{{- end -}}
{{- end -}}
