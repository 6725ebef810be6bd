{{/* Chart name. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name. */}}
{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvgate.selector" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvgate.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}

{{/* The chart's own Secret (the secrets it generates or is given as values). */}}
{{- define "kvgate.secretName" -}}{{ include "kvgate.fullname" . }}-secrets{{- end -}}

{{/* Does the gateway log in to Redis with a password from a Secret? "internal" (the in-chart Redis with its ACL
user), "external" (redis.auth.existingSecret of an external Redis) or "". */}}
{{- define "kvgate.redisAuth" -}}
{{- $r := .Values.redis -}}
{{- if $r.enabled -}}
{{- if and (eq $r.mode "internal") $r.auth.enabled -}}internal
{{- else if and (eq $r.mode "external") $r.auth.existingSecret -}}external
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Redis ACL user the gateway logs in as ("": none). */}}
{{- define "kvgate.redisUsername" -}}
{{- $auth := include "kvgate.redisAuth" . -}}
{{- if eq $auth "internal" -}}{{ .Values.redis.auth.username | default "kvgate" }}
{{- else if eq $auth "external" -}}{{ .Values.redis.auth.username }}
{{- end -}}
{{- end -}}

{{/* Where each secret the pods read comes from, as JSON: {use: {name, key, managed}} for the uses `report`,
`admin`, `redis` (the Redis password, when there is one) and `redisUrl` (an external Redis's urlSecret).
`managed`: a key of the chart's own Secret. */}}
{{- define "kvgate.secretRefs" -}}
{{- $s := .Values.secrets -}}
{{- $chart := include "kvgate.secretName" . -}}
{{- $refs := dict -}}
{{- if $s.reportSecretFrom.existingSecret -}}
{{- $_ := set $refs "report" (dict "name" $s.reportSecretFrom.existingSecret "key" $s.reportSecretFrom.existingSecretKey "managed" false) -}}
{{- else if $s.existingSecret -}}
{{- $_ := set $refs "report" (dict "name" $s.existingSecret "key" "report-secret" "managed" false) -}}
{{- else -}}
{{- $_ := set $refs "report" (dict "name" $chart "key" "report-secret" "managed" true) -}}
{{- end -}}
{{- if $s.adminTokenFrom.existingSecret -}}
{{- $_ := set $refs "admin" (dict "name" $s.adminTokenFrom.existingSecret "key" $s.adminTokenFrom.existingSecretKey "managed" false) -}}
{{- else if $s.existingSecret -}}
{{- $_ := set $refs "admin" (dict "name" $s.existingSecret "key" "admin-token" "managed" false) -}}
{{- else -}}
{{- $_ := set $refs "admin" (dict "name" $chart "key" "admin-token" "managed" true) -}}
{{- end -}}
{{- $auth := include "kvgate.redisAuth" . -}}
{{- $ra := .Values.redis.auth -}}
{{- if $ra.existingSecret -}}
{{- if $auth -}}
{{- $_ := set $refs "redis" (dict "name" $ra.existingSecret "key" $ra.existingSecretKey "managed" false) -}}
{{- end -}}
{{- else if eq $auth "internal" -}}
{{- $_ := set $refs "redis" (dict "name" $chart "key" "redis-password" "managed" true) -}}
{{- end -}}
{{- if and .Values.redis.enabled (eq .Values.redis.mode "external") .Values.redis.urlSecret -}}
{{- $_ := set $refs "redisUrl" (dict "name" .Values.redis.urlSecret "key" "redis-url" "managed" false) -}}
{{- end -}}
{{- if and .Values.epp.enabled (eq .Values.epp.auth.mode "token") .Values.epp.auth.tokenSecret -}}
{{- $_ := set $refs "eppToken" (dict "name" .Values.epp.auth.tokenSecret "key" "token" "managed" false) -}}
{{- end -}}
{{- toJson $refs -}}
{{- end -}}

{{/* Computes, once per render, the chart's Secret data and the values behind every secret reference (kept in
.Values._kvgateSecrets: templates share .Values, so the Secret and the pods' checksums see the same generated
values). Generated values: the given one, else the installed Secret's (lookup; nothing under `helm template`), else
40 random characters. A Secret the user manages contributes its resourceVersion as lookup finds it ("" when
nothing: under `helm template` its rotation does not roll the pods), never its value (a hash of a weak password in a
pod annotation could be guessed). */}}
{{- define "kvgate.initSecrets" -}}
{{- if not (hasKey .Values "_kvgateSecrets") -}}
{{- $refs := include "kvgate.secretRefs" . | fromJson -}}
{{- $installed := lookup "v1" "Secret" .Release.Namespace (include "kvgate.secretName" .) -}}
{{- $old := dict -}}
{{- if $installed }}{{ $old = default dict $installed.data }}{{ end -}}
{{- $given := dict "report-secret" .Values.secrets.reportSecret "admin-token" .Values.secrets.adminToken "redis-password" .Values.secrets.redisPassword -}}
{{- $data := dict -}}
{{- $values := dict -}}
{{- range $use, $ref := $refs -}}
{{- $v := "" -}}
{{- if $ref.managed -}}
{{- $g := get $given $ref.key -}}
{{- if $g -}}{{ $v = $g | b64enc }}{{- else -}}{{ $v = get $old $ref.key | default (randAlphaNum 40 | b64enc) }}{{- end -}}
{{- $_ := set $data $ref.key $v -}}
{{- else -}}
{{- $user := lookup "v1" "Secret" $.Release.Namespace $ref.name -}}
{{- if $user }}{{ $v = printf "rv:%s" (default "" $user.metadata.resourceVersion) }}{{ end -}}
{{- end -}}
{{- $_ := set $values (printf "%s/%s" $ref.name $ref.key) $v -}}
{{- end -}}
{{- $_ := set .Values "_kvgateSecrets" (dict "data" $data "values" $values "refs" $refs) -}}
{{- end -}}
{{- end -}}

{{/* checksum/secret of a pod: sha256 of the JSON {"<secret>/<key>": base64 value (the chart's own) or
resourceVersion (a user's)} of the secrets it reads.
Call with (dict "root" $ "uses" (list "report" ...)). */}}
{{- define "kvgate.secretChecksum" -}}
{{- include "kvgate.initSecrets" .root -}}
{{- $st := .root.Values._kvgateSecrets -}}
{{- $in := dict -}}
{{- range $use := .uses -}}
{{- with get $st.refs $use -}}
{{- $k := printf "%s/%s" .name .key -}}
{{- $_ := set $in $k (get $st.values $k) -}}
{{- end -}}
{{- end -}}
{{- toJson $in | sha256sum -}}
{{- end -}}

{{/* An env entry reading one secret reference. Call with (dict "env" NAME "ref" REF). */}}
{{- define "kvgate.secretEnv" -}}
- name: {{ .env }}
  valueFrom:
    secretKeyRef:
      name: {{ .ref.name }}
      key: {{ .ref.key }}
{{- end -}}

{{- define "kvgate.gatewayName" -}}{{ include "kvgate.fullname" . }}-gateway{{- end -}}
{{- define "kvgate.controlName" -}}{{ include "kvgate.fullname" . }}-control{{- end -}}
{{- define "kvgate.workerName" -}}{{ include "kvgate.fullname" . }}-worker{{- end -}}
{{- define "kvgate.redisName" -}}{{ include "kvgate.fullname" . }}-redis{{- end -}}
{{- define "kvgate.eppName" -}}{{ include "kvgate.fullname" . }}-epp{{- end -}}
{{- define "kvgate.poolServiceName" -}}{{ include "kvgate.fullname" . }}-pool{{- end -}}
{{/* The pool's selector as k=v,k=v (sorted), for messages. */}}
{{- define "kvgate.poolSelectorText" -}}
{{- $out := list -}}
{{- range $k, $v := .Values.epp.pool.selector }}{{ $out = append $out (printf "%s=%s" $k $v) }}{{ end -}}
{{- join "," $out -}}
{{- end -}}
{{- define "kvgate.poolName" -}}{{ .Values.epp.pool.name | default (include "kvgate.fullname" .) }}{{- end -}}

{{/* Does the endpoint picker serve TLS? "true" or "". */}}
{{- define "kvgate.eppTls" -}}
{{- if and .Values.epp.enabled .Values.epp.tls.enabled -}}true{{- end -}}
{{- end -}}

{{/* The picker's kubernetes.io/tls Secret: epp.tls.secretName, else the chart's `<fullname>-epp-tls`. */}}
{{- define "kvgate.eppTlsSecretName" -}}
{{- .Values.epp.tls.secretName | default (printf "%s-epp-tls" (include "kvgate.fullname" .)) -}}
{{- end -}}

{{/* Where the gateway container reads the picker's certificate and key (epp-tls-cert, epp-tls-key). */}}
{{- define "kvgate.eppTlsDir" -}}/etc/kvgate/epp-tls{{- end -}}

{{/* Where the gateway container reads the CA of the proxies' client certificates (epp.auth.mode mtls). */}}
{{- define "kvgate.eppClientCaDir" -}}/etc/kvgate/epp-client-ca{{- end -}}

{{/* Refuses a picker whose callers nothing tells apart (epp.auth): network needs an enforced, non-empty eppFrom;
token its Secret; mtls its CA's Secret and TLS. */}}
{{- define "kvgate.eppAuthCheck" -}}
{{- $epp := .Values.epp -}}
{{- $np := .Values.networkPolicy -}}
{{- if $epp.enabled -}}
{{- if eq $epp.auth.mode "network" -}}
{{- if not $np.enabled -}}
{{- fail "epp.auth.mode network trusts the NetworkPolicy to let only the proxies reach the picker, but networkPolicy.enabled is false: enable it, or use epp.auth.mode token or mtls" -}}
{{- end -}}
{{- if not $np.eppFrom -}}
{{- fail "epp.auth.mode network with an empty networkPolicy.eppFrom lets anyone drive the picker: name the inference gateway's proxies there, or use epp.auth.mode token or mtls" -}}
{{- end -}}
{{- else if eq $epp.auth.mode "token" -}}
{{- if not $epp.auth.tokenSecret -}}
{{- fail "epp.auth.mode token needs epp.auth.tokenSecret: a Secret whose key `token` the proxies send as gRPC metadata authorization: Bearer <token>" -}}
{{- end -}}
{{- else if eq $epp.auth.mode "mtls" -}}
{{- if not $epp.auth.clientCASecret -}}
{{- fail "epp.auth.mode mtls needs epp.auth.clientCASecret: a Secret whose key `ca.crt` the proxies' client certificates chain to" -}}
{{- end -}}
{{- if not $epp.tls.enabled -}}
{{- fail "epp.auth.mode mtls needs epp.tls.enabled: mutual TLS is TLS first" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Computes, once per render, the picker's TLS (kept in .Values._kvgateEppTls, as kvgate.initSecrets does):
`data`, the chart's Secret's tls.crt / tls.key (base64) when no epp.tls.secretName is given: the installed
Secret's (lookup: kept across upgrades), else a new self-signed certificate for the EPP Service's DNS names, valid
10 years (genSelfSignedCert; under `helm template` lookup finds nothing, so every render makes a new one); and
`checksum`, what rolls the gateway pods: a named Secret's resourceVersion as lookup finds it ("" under `helm
template`), nothing for the chart's own (whatever certificate a pod read at start serves: the proxies do not
verify it, and a certificate new on every `helm template` render must not roll the pods every sync). */}}
{{- define "kvgate.initEppTls" -}}
{{- if not (hasKey .Values "_kvgateEppTls") -}}
{{- $data := dict -}}
{{- $sum := "" -}}
{{- $name := include "kvgate.eppTlsSecretName" . -}}
{{- if include "kvgate.eppTls" . -}}
{{- $installed := lookup "v1" "Secret" .Release.Namespace $name -}}
{{- if .Values.epp.tls.secretName -}}
{{- if $installed }}{{ $sum = printf "rv:%s" (default "" $installed.metadata.resourceVersion) }}{{ end -}}
{{- else -}}
{{- $old := dict -}}
{{- if $installed }}{{ $old = default dict $installed.data }}{{ end -}}
{{- if and (get $old "tls.crt") (get $old "tls.key") -}}
{{- $data = dict "tls.crt" (get $old "tls.crt") "tls.key" (get $old "tls.key") -}}
{{- else -}}
{{- $svc := include "kvgate.eppName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $dns := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) -}}
{{- $cert := genSelfSignedCert (printf "%s.%s.svc" $svc $ns) nil $dns 3650 -}}
{{- $data = dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := set .Values "_kvgateEppTls" (dict "data" $data "checksum" $sum) -}}
{{- end -}}
{{- end -}}

{{/* Does the chart deploy kvgate workers? "true", or "" when the gateway fronts pods it does not own
(workers.external.service, or the InferencePool's pods with epp.enabled). */}}
{{- define "kvgate.kvWorkers" -}}
{{- if not (or .Values.workers.external.service .Values.epp.enabled) -}}true{{- end -}}
{{- end -}}

{{/* The fronted pods as JSON, in the shape of workers.external: workers.external itself, or with epp.enabled the
InferencePool's pods (service: the chart's headless Service over the pool's selector, whose DNS name lists the Ready
pods; port, model and kind from epp.pool; tokenizer and KV settings from workers.external). `service` is empty when
the chart deploys kvgate workers. Numbers come back from fromJson as floats: print them with int64. */}}
{{- define "kvgate.fronted" -}}
{{- $f := deepCopy .Values.workers.external -}}
{{- if .Values.epp.enabled -}}
{{- $p := .Values.epp.pool -}}
{{- $_ := set $f "service" (printf "%s.%s.svc.cluster.local" (include "kvgate.poolServiceName" .) .Release.Namespace) -}}
{{- $_ = set $f "port" $p.targetPort -}}
{{- $_ = set $f "model" $p.model -}}
{{- $_ = set $f "kind" $p.kind -}}
{{- end -}}
{{- toJson $f -}}
{{- end -}}

{{/* The control Service's in-cluster URL (workers report there). */}}
{{- define "kvgate.controlUrl" -}}
http://{{ include "kvgate.controlName" . }}.{{ .Release.Namespace }}.svc.cluster.local:{{ .Values.gateway.controlPort }}
{{- end -}}

{{/* The Redis URL, if any. */}}
{{- define "kvgate.redisUrl" -}}
{{- if eq .Values.redis.mode "external" -}}
{{ .Values.redis.url }}
{{- else -}}
redis://{{ include "kvgate.redisName" . }}.{{ .Release.Namespace }}.svc.cluster.local:6379
{{- end -}}
{{- end -}}

{{/* A float for TOML (always with a decimal point). */}}
{{- define "kvgate.float" -}}{{ printf "%.6f" (float64 .) }}{{- end -}}

{{- /* One TOML line, `key = value`, unless the value is null: then the line is left out and the binary's own
default applies (each default is written once, in the code: docs/reference/). (list key value kind), kind: str,
int, float or bool. */ -}}
{{- define "kvgate.toml" -}}
{{- $k := index . 0 -}}{{- $v := index . 1 -}}{{- $t := index . 2 -}}
{{- if not (kindIs "invalid" $v) -}}
{{ $k }} = {{ if eq $t "str" }}{{ $v | quote }}{{ else if eq $t "int" }}{{ int64 $v }}{{ else if eq $t "float" }}{{ include "kvgate.float" $v }}{{ else }}{{ $v }}{{ end }}
{{- end -}}
{{- end -}}
