{{/* A PodDisruptionBudget for a component: (dict "root" $ "component" "edge" "pdb" .Values.edge.pdb) */}}
{{- define "chatmesh.pdb" }}
{{- $c := dict "root" .root "component" .component }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "chatmesh.component" $c }}
  labels:
    {{- include "chatmesh.labels" $c | nindent 4 }}
spec:
  {{- toYaml .pdb | nindent 2 }}
  selector:
    matchLabels:
      {{- include "chatmesh.selectorLabels" $c | nindent 6 }}
{{- end }}

{{/* A CPU HorizontalPodAutoscaler: (dict "root" $ "component" "edge" "kind" "Deployment" "autoscaling" ...) */}}
{{- define "chatmesh.hpa" }}
{{- if .autoscaling.enabled }}
{{- $c := dict "root" .root "component" .component }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "chatmesh.component" $c }}
  labels:
    {{- include "chatmesh.labels" $c | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ .kind }}
    name: {{ include "chatmesh.component" $c }}
  minReplicas: {{ .autoscaling.minReplicas }}
  maxReplicas: {{ .autoscaling.maxReplicas }}
  metrics:
  - type: Resource
    resource:
      name: cpu
      target:
        type: Utilization
        averageUtilization: {{ .autoscaling.targetCPUUtilizationPercentage }}
  behavior:
    # Long-lived streams: scale in slowly, so draining replicas are not replaced by more draining.
    scaleDown:
      stabilizationWindowSeconds: 300
      policies:
      - {type: Pods, value: 1, periodSeconds: 60}
{{- end }}
{{- end }}
