{{/* Names: <release>-kvflow unless the release name already says kvflow. */}}
{{- define "kvflow.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvflow.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The pods of one component: `include "kvflow.selector" (list . "frontend")`. */}}
{{- define "kvflow.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvflow.frontendAddress" -}}
tcp://{{ include "kvflow.fullname" . }}-frontend-zmq:{{ .Values.ports.frontend }}
{{- end -}}

{{/* A flag's value as a string, or `default` where the flag is not set:
`include "kvflow.flag" (list . "data-parallel-size" 1)`. Numbers are compared as numbers after
this, never tested for truth, nor given a `default`: a number's truth depends on how helm read
it. Helm 4 and Helm 3 read a values file's 0 as a number, which is false (and `default` replaces
it), but Helm 3.18.0 reads the chart's own values.yaml's 0 as a json.Number, a string, which is
true (and kept). */}}
{{- define "kvflow.flag" -}}
{{- $flags := (index . 0).Values.flags -}}
{{- $name := index . 1 -}}
{{- if and (hasKey $flags $name) (not (kindIs "invalid" (index $flags $name))) -}}
{{- index $flags $name | toString -}}
{{- else -}}
{{- index . 2 | toString -}}
{{- end -}}
{{- end -}}

{{/* Engine replicas: flags.data-parallel-size, one engine pod each. */}}
{{- define "kvflow.replicas" -}}
{{- $given := include "kvflow.flag" (list . "data-parallel-size" 1) -}}
{{- $replicas := atoi $given -}}
{{- if or (lt $replicas 1) (ne (toString $replicas) $given) -}}
{{- fail (printf "flags.data-parallel-size must be a whole number >= 1, not %q" $given) -}}
{{- end -}}
{{- $replicas -}}
{{- end -}}

{{/* Every engine pod's address on a port, replica 0 first, by the pod's name under the
headless Service: `include "kvflow.engineAddresses" (list . .Values.ports.scheduler)`. */}}
{{- define "kvflow.engineAddresses" -}}
{{- $root := index . 0 -}}
{{- $port := index . 1 -}}
{{- $name := include "kvflow.fullname" $root -}}
{{- $addresses := list -}}
{{- range $replica := until (include "kvflow.replicas" $root | int) -}}
{{- $addresses = append $addresses (printf "tcp://%s-engine-%d.%s-engine:%v" $name $replica $name $port) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* One address for every replica's entry (an engine pod binds or connects its own):
`include "kvflow.everyReplica" (list . "tcp://0.0.0.0:5558")`. */}}
{{- define "kvflow.everyReplica" -}}
{{- $address := index . 1 -}}
{{- $addresses := list -}}
{{- range until (include "kvflow.replicas" (index . 0) | int) -}}
{{- $addresses = append $addresses $address -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* An engine container's replica: its pod's index in the StatefulSet (Kubernetes 1.28+). */}}
{{- define "kvflow.replicaRank" -}}
- name: KVFLOW_DATA_PARALLEL_RANK
  valueFrom:
    fieldRef: {fieldPath: "metadata.labels['apps.kubernetes.io/pod-index']"}
{{- end -}}

{{/* What every kvflow container shares: the image, the settings, the security context. */}}
{{- define "kvflow.container" -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
envFrom:
  - configMapRef:
      name: {{ include "kvflow.fullname" . }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{/* Writable places under a read-only root, the CURVE keys, and the model folder. */}}
{{- define "kvflow.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: home, mountPath: /home/kvflow}
{{- if .Values.curveKeys.existingSecret }}
- {name: curve-keys, mountPath: {{ .Values.curveKeys.mountPath }}, readOnly: true}
{{- end }}
{{- if .Values.modelVolume.enabled }}
- {name: models, mountPath: {{ .Values.modelVolume.mountPath }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "kvflow.volumes" -}}
- {name: tmp, emptyDir: {}}
- {name: home, emptyDir: {}}
{{- with .Values.curveKeys.existingSecret }}
- name: curve-keys
  secret: {secretName: {{ . }}, defaultMode: 288}  # 0440: read through the fsGroup
{{- end }}
{{- if .Values.modelVolume.enabled }}
- name: models
  {{- if .Values.modelVolume.existingClaim }}
  persistentVolumeClaim: {claimName: {{ .Values.modelVolume.existingClaim }}, readOnly: true}
  {{- else if .Values.modelVolume.hostPath }}
  hostPath: {path: {{ .Values.modelVolume.hostPath }}, type: Directory}
  {{- else }}
  {{- fail "modelVolume.enabled needs modelVolume.existingClaim or modelVolume.hostPath" }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by every component: `include "kvflow.podSpec" (list . .Values.tokenizer)`. */}}
{{- define "kvflow.podSpec" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $component.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
