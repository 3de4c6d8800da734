{{/*
Who may talk to whom: the shared gRPC token between gateways and workers, and the Redis ACL
users workers and gateways connect as (docs/SECURITY.md says what each does and does not stop).
*/}}

{{/* Where gateway and worker pods find the shared token (`--grpc-token-file`). */}}
{{- define "kvroute.grpcTokenPath" -}}
/etc/kvroute/grpc-token/token
{{- end }}

{{- define "kvroute.grpcTokenSecretName" -}}
{{- if .Values.grpcAuth.existingSecret }}
{{- .Values.grpcAuth.existingSecret }}
{{- else }}
{{- include "kvroute.componentName" (dict "root" . "component" "grpc-token") }}
{{- end }}
{{- end }}

{{- define "kvroute.grpcTokenSecretKey" -}}
{{- if .Values.grpcAuth.existingSecret }}
{{- .Values.grpcAuth.existingSecretKey }}
{{- else -}}
token
{{- end }}
{{- end }}

{{/* The token's volume; the file is readable by the pod's group (fsGroup) only. */}}
{{- define "kvroute.grpcTokenVolume" -}}
{{- if .Values.grpcAuth.enabled -}}
- name: grpc-token
  secret:
    secretName: {{ include "kvroute.grpcTokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ include "kvroute.grpcTokenSecretKey" . }}
        path: token
{{- end }}
{{- end }}

{{- define "kvroute.grpcTokenMount" -}}
{{- if .Values.grpcAuth.enabled -}}
- name: grpc-token
  mountPath: {{ include "kvroute.grpcTokenPath" . | dir }}
  readOnly: true
{{- end }}
{{- end }}

{{/* "true" when the in-chart Redis runs with ACL users (it needs the default user's password). */}}
{{- define "kvroute.redisAcl" -}}
{{- $r := .Values.redis }}
{{- if and $r.enabled $r.auth.enabled $r.acl.enabled -}}
true
{{- end }}
{{- end }}

{{/* The Redis URL of one role; dict "root" $ "role" "worker|gateway". With ACLs it names
the role's user (never a password: that comes from the Secret). */}}
{{- define "kvroute.redisUrlAs" -}}
{{- $url := include "kvroute.redisUrl" .root }}
{{- if include "kvroute.redisAcl" .root }}
{{- $url = replace "redis://" (printf "redis://kvroute-%s@" .role) $url }}
{{- end }}
{{- $url }}
{{- end }}

{{/* Key, in the Redis Secret, of one role's password; dict "root" $ "role" "worker|gateway". */}}
{{- define "kvroute.redisPasswordKeyAs" -}}
{{- $root := .root }}
{{- if not (include "kvroute.redisAcl" $root) }}
{{- include "kvroute.redisSecretKey" $root }}
{{- else if $root.Values.redis.auth.existingSecret }}
{{- index $root.Values.redis.acl (printf "%sPasswordKey" .role) }}
{{- else }}
{{- printf "%s-password" .role }}
{{- end }}
{{- end }}

{{/* KVROUTE_REDIS_PASSWORD of one role, from the Secret; the CLIs combine it with the URL.
dict "root" $ "role" "worker|gateway". */}}
{{- define "kvroute.redisPasswordEnvAs" -}}
{{- if .root.Values.redis.auth.enabled -}}
- name: KVROUTE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvroute.redisSecretName" .root }}
      key: {{ include "kvroute.redisPasswordKeyAs" . }}
{{- end }}
{{- end }}
