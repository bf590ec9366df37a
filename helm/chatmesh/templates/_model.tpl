{{/*
The model volume (values `model`): the weights and tokenizer engines serve and the orchestrator's tokenizer
and chat template, mounted read-only. Nothing is rendered while model.path is empty (the image's bundled
model).
*/}}

{{/* The path the services are given: <mountPath>/<path>, or empty for the bundled model. */}}
{{- define "chatmesh.modelFile" -}}
{{- with .Values.model.path -}}
{{- printf "%s/%s" (trimSuffix "/" $.Values.model.mountPath) (trimSuffix "/" .) -}}
{{- end -}}
{{- end -}}

{{/* Copies the files out of an image (model.image.mode copy) before the service starts. The orchestrator
takes only what its tokenizer reads: a GGUF file whole, a directory without its weights.
(dict "root" $ "weights" true|false) */}}
{{- define "chatmesh.modelInit" -}}
{{- $m := .root.Values.model -}}
{{- if and $m.path (eq $m.source "image") (eq $m.image.mode "copy") }}
- name: copy-model
  image: {{ required "model.image.reference: name the image that holds the model files" $m.image.reference }}
  imagePullPolicy: {{ $m.image.pullPolicy }}
  command: ["sh", "-c"]
  args:
  - |
    set -e
    {{- if .weights }}
    cp -R "$1/." "$2/"
    {{- else }}
    if [ -d "$1/$3" ]; then
      mkdir -p "$2/$3"
      for f in "$1/$3"/*; do
        case "$f" in *.safetensors|*.bin|*.pt|*.pth|*.gguf) ;; *) cp -R "$f" "$2/$3/" ;; esac
      done
    else
      mkdir -p "$(dirname "$2/$3")"; cp "$1/$3" "$2/$3"
    fi
    {{- end }}
  - copy-model
  - {{ $m.image.sourceDir | quote }}
  - /model-copy
  - {{ $m.path | quote }}
  {{- include "chatmesh.containerSecurity" .root | nindent 2 }}
  resources:
    requests: {cpu: 500m, memory: 256Mi}
    limits: {memory: 1Gi}
  volumeMounts:
  - {name: model, mountPath: /model-copy}
{{- end }}
{{- end -}}

{{- define "chatmesh.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if $m.path }}
- name: model
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName: name the PersistentVolumeClaim that holds model.path (or pick another model.source)" $m.pvc.claimName | quote }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path: the directory on the nodes that holds model.path" $m.hostPath.path | quote }}
    type: Directory
{{- else if eq $m.image.mode "volume" }}
  image:
    reference: {{ required "model.image.reference: name the image that holds the model files" $m.image.reference | quote }}
    pullPolicy: {{ $m.image.pullPolicy }}
{{- else }}
  emptyDir: {sizeLimit: {{ $m.image.sizeLimit }}}
{{- end }}
{{- end }}
{{- end -}}

{{- define "chatmesh.modelMount" -}}
{{- if .Values.model.path }}
- {name: model, mountPath: {{ .Values.model.mountPath | quote }}, readOnly: true}
{{- end }}
{{- end -}}
