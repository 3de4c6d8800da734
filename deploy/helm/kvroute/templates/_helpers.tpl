{{/*
Names, labels and the pieces every component shares (image, Redis settings, model volume).
*/}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-kvroute, or the release name alone when it already contains the chart name. */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one component's resources; dict "root" $ "component" "gateway". Cut to 42
characters so a StatefulSet's controller-revision-hash label (name + 11) stays within 63. */}}
{{- define "kvroute.componentName" -}}
{{- printf "%s-%s" (include "kvroute.fullname" .root | trunc 42 | trimSuffix "-") .component }}
{{- end }}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of every resource of one component; dict "root" $ "component" "gateway". */}}
{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" .root }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag of one component; dict "root" $ "image" .Values.gateway.image. */}}
{{- define "kvroute.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The Redis URL handed to workers and gateways. It never carries the password. */}}
{{- define "kvroute.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "kvroute.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) }}
{{- else }}
{{- required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{- define "kvroute.redisSecretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else }}
{{- include "kvroute.componentName" (dict "root" . "component" "redis") }}
{{- end }}
{{- end }}

{{- define "kvroute.redisSecretKey" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecretPasswordKey }}
{{- else -}}
redis-password
{{- end }}
{{- end }}

{{/* Writable scratch for a read-only root filesystem: caches go under /tmp. */}}
{{- define "kvroute.scratchEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/hf
- name: KVROUTE_CACHE_DIR
  value: /tmp/kvroute
{{- end }}

{{- define "kvroute.modelVolume" -}}
{{- $v := .Values.model.volume -}}
- name: model
{{- if eq $v.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.volume.claimName is required for model.volume.type pvc" $v.claimName }}
    readOnly: {{ not .Values.model.download.enabled }}
{{- else if eq $v.type "hostPath" }}
  hostPath:
    path: {{ required "model.volume.hostPath is required for model.volume.type hostPath" $v.hostPath }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ $v.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "kvroute.modelVolumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Where the gateway finds its tokenizer folder. Its last path segment is the model folder's
name, so the served name the gateway derives from it equals the workers'. */}}
{{- define "kvroute.gatewayModelPath" -}}
{{- if eq .Values.gateway.tokenizer.source "model" }}
{{- .Values.model.path }}
{{- else }}
{{- printf "/tokenizer/%s" (base .Values.model.path) }}
{{- end }}
{{- end }}

{{/* The gateway's volumes: the model volume only with tokenizer.source "model". */}}
{{- define "kvroute.gatewayVolumes" -}}
{{- $t := .Values.gateway.tokenizer -}}
{{- if eq $t.source "model" }}
{{- include "kvroute.modelVolume" . }}
{{- else }}
- name: tokenizer
{{- if eq $t.source "configMap" }}
  configMap:
    name: {{ required "gateway.tokenizer.configMap is required for gateway.tokenizer.source configMap" $t.configMap }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $t.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "kvroute.gatewayVolumeMounts" -}}
{{- if eq .Values.gateway.tokenizer.source "model" }}
{{- include "kvroute.modelVolumeMounts" . }}
{{- else }}
- name: tokenizer
  mountPath: {{ include "kvroute.gatewayModelPath" . }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}
{{- end }}

{{/* tokenizer.source "init": a small init container writes the tokenizer files. */}}
{{- define "kvroute.tokenizerInitContainer" -}}
{{- with .Values.gateway.tokenizer.init }}
- name: tokenizer-fetch
  image: {{ required "gateway.tokenizer.init.image is required for gateway.tokenizer.source init" .image }}
  command:
    {{- toYaml .command | nindent 4 }}
  env:
    - name: KVROUTE_TOKENIZER_PATH
      value: {{ include "kvroute.gatewayModelPath" $ | quote }}
    {{- with .env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: tokenizer
      mountPath: {{ include "kvroute.gatewayModelPath" $ }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* podAntiAffinity from a preset ("soft": prefer other nodes; "hard": require them; "none"),
unless `affinity` is given explicitly. Call with dict "root" . "component" "gateway|worker". */}}
{{- define "kvroute.affinity" -}}
{{- $v := index .root.Values .component }}
{{- if $v.affinity }}
{{- toYaml $v.affinity }}
{{- else if eq $v.podAntiAffinity "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "kvroute.selectorLabels" . | nindent 12 }}
{{- else if eq $v.podAntiAffinity "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "kvroute.selectorLabels" . | nindent 10 }}
{{- end }}
{{- end }}

{{/* topologySpreadConstraints, each given this component's pod selector when it has none. */}}
{{- define "kvroute.topologySpread" -}}
{{- $v := index .root.Values .component }}
{{- $ctx := . }}
{{- range $v.topologySpreadConstraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (include "kvroute.selectorLabels" $ctx | fromYaml)) }}
{{- end }}
- {{- toYaml $c | nindent 2 }}
{{- end }}
{{- end }}

{{/* Optional init container that fills the model volume before kvroute starts. */}}
{{- define "kvroute.downloadInitContainer" -}}
{{- with .Values.model.download }}
{{- if .enabled }}
- name: model-download
  image: {{ required "model.download.image is required when model.download.enabled" .image }}
  command:
    {{- toYaml .command | nindent 4 }}
  env:
    - name: KVROUTE_MODEL_PATH
      value: {{ $.Values.model.path | quote }}
    {{- with .env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $.Values.model.volume.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}
{{- end }}
