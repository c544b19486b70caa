{{/*
Helpers shared by the chart's templates (csi/ and cache-engine/).

The objects keep the fixed names of the kustomize directories (objfs-csi-node, the driver
csi.objfs.dev): objfs looks its driver up by that name, so the chart is installed once per
cluster. Their labels are the ones those directories have always had; Helm tracks the objects
it owns through its own annotations and needs none of its own.
*/}}

{{/*
objfs.name: the chart's name.
*/}}
{{- define "objfs.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
objfs.fullname: the release's name, followed by the chart's unless it already holds it
("objfs" for a release named objfs). Truncated to 63 characters, a DNS label's limit.
*/}}
{{- define "objfs.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
objfs.selectorLabels: the labels that pick a component's pods, for selectors and pod
templates. Called with a dict: (dict "name" "objfs-csi-node"). A DaemonSet's selector cannot
change once created: keep these as they are.
*/}}
{{- define "objfs.selectorLabels" -}}
app.kubernetes.io/name: {{ .name }}
{{- end -}}

{{/*
objfs.labels: the labels of a component's objects. Called with a dict:
(dict "name" "objfs-csi-node" "context" $).
*/}}
{{- define "objfs.labels" -}}
{{ include "objfs.selectorLabels" (dict "name" .name) }}
{{- end -}}

{{/*
objfs.image: an image reference, REGISTRY/REPOSITORY:TAG, from a values mapping with the keys
registry (optional), repository and tag (empty: the chart's appVersion). Called with a dict:
(dict "image" .Values.image "context" $).
*/}}
{{- define "objfs.image" -}}
{{- $tag := .image.tag | default .context.Chart.AppVersion | toString -}}
{{- if .image.registry -}}
{{- printf "%s/%s:%s" .image.registry .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}
