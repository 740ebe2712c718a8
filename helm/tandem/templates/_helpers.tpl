{{/* Names, labels and the pieces the RayCluster's groups share. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Kept to 40 characters: KubeRay appends group and pod suffixes to the RayCluster name. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* Selector of one group's pods: (dict "ctx" $ "component" "prefill") */}}
{{- define "tandem.componentSelector" -}}
{{ include "tandem.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tandem.modelPath" -}}
{{- required "model.path is required: the directory of the Hugging Face checkpoint inside the pods, e.g. --set model.path=/models/Qwen2.5-7B-Instruct" .Values.model.path }}
{{- end }}

{{- define "tandem.servedModelName" -}}
{{- default (base (include "tandem.modelPath" .)) .Values.model.servedModelName }}
{{- end }}

{{- define "tandem.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "tandem.fullname" .)) .Values.apiKey.existingSecret }}
{{- end }}

{{/* Units of a pool's Ray resource one pod advertises: its GPUs, or cpuSlots on CPU. */}}
{{- define "tandem.poolSlots" -}}
{{- if gt (int .gpusPerPod) 0 }}{{ int .gpusPerPod }}{{ else }}{{ int .cpuSlots }}{{ end }}
{{- end }}

{{/*
Checks JSON schema cannot express (it does not compare two values). Each message names the
keys to change.
*/}}
{{- define "tandem.validate" -}}
{{- $v := .Values }}
{{- include "tandem.modelPath" . }}
{{- range $pool := list "prefill" "decode" }}
{{- $g := index $v $pool }}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) }}
{{- fail (printf "%s.minReplicas (%d) must be <= %s.maxReplicas (%d)" $pool (int $g.minReplicas) $pool (int $g.maxReplicas)) }}
{{- end }}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) }}
{{- fail (printf "%s.replicas (%d) must lie between %s.minReplicas (%d) and %s.maxReplicas (%d)" $pool (int $g.replicas) $pool (int $g.minReplicas) $pool (int $g.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if eq $v.serving.mode "disagg" }}
{{- range $pool := list "prefill" "decode" }}
{{- $g := index $v $pool }}
{{- $cap := mul (int $g.maxReplicas) (int (include "tandem.poolSlots" $g)) }}
{{- if gt (int (index $v.serving $pool)) $cap }}
{{- fail (printf "serving.%s (%d actors) exceeds what %s.maxReplicas x slots per pod can hold (%d)" $pool (int (index $v.serving $pool)) $pool $cap) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq $v.prefill.rayResource $v.decode.rayResource }}
{{- fail "prefill.rayResource and decode.rayResource must differ, or actors of one pool land on the other's pods" }}
{{- end }}
{{- if and $v.model.volume (not (hasPrefix (printf "%s/" (trimSuffix "/" $v.model.mountPath)) (include "tandem.modelPath" .))) }}
{{- fail (printf "model.path (%s) must lie under model.mountPath (%s), where model.volume is mounted" (include "tandem.modelPath" .) $v.model.mountPath) }}
{{- end }}
{{- if gt (int $v.ports.zmq.first) (int $v.ports.zmq.last) }}
{{- fail "ports.zmq.first must be <= ports.zmq.last" }}
{{- end }}
{{- if gt (int $v.ports.nixl.first) (int $v.ports.nixl.last) }}
{{- fail "ports.nixl.first must be <= ports.nixl.last" }}
{{- end }}
{{- $home := trimSuffix "/" $v.scratch.home.mountPath }}
{{- if or (has $home (list "/tmp" "/tmp/ray" "/dev/shm" (trimSuffix "/" $v.model.mountPath))) (hasPrefix "/tmp/" $home) }}
{{- fail (printf "scratch.home.mountPath (%s) must not be /tmp, /dev/shm, model.mountPath or under /tmp: those are mounted already" $v.scratch.home.mountPath) }}
{{- end }}
{{- if gt (int $v.ray.ports.minWorkerPort) (int $v.ray.ports.maxWorkerPort) }}
{{- fail "ray.ports.minWorkerPort must be <= ray.ports.maxWorkerPort" }}
{{- end }}
{{- end }}

{{/* UCX_TLS for a pool: (dict "ctx" $ "pool" .Values.prefill); the head (pool.head) has no RDMA device. */}}
{{- define "tandem.ucxTls" -}}
{{- $v := .ctx.Values -}}
{{- $rdma := and $v.rdma.enabled (not .pool.head) -}}
{{- if $v.ucx.tls }}{{ $v.ucx.tls }}
{{- else if and $rdma (gt (int .pool.gpusPerPod) 0) }}rc,ud,sm,self,cuda_copy,cuda_ipc
{{- else if $rdma }}rc,ud,sm,self
{{- else if gt (int .pool.gpusPerPod) 0 }}tcp,sm,self,cuda_copy,cuda_ipc
{{- else }}tcp,sm,self
{{- end }}
{{- end }}

{{/* Environment every Ray container shares: the data-plane port ranges and UCX settings. */}}
{{- define "tandem.commonEnv" -}}
{{- $v := .ctx.Values -}}
# The image's own HOME may be read-only: Ray and the caches write under this emptyDir.
- name: HOME
  value: {{ $v.scratch.home.mountPath | quote }}
- name: TANDEM_ZMQ_PORT_RANGE
  value: {{ printf "%d-%d" (int $v.ports.zmq.first) (int $v.ports.zmq.last) | quote }}
- name: UCX_TCP_PORT_RANGE
  value: {{ printf "%d-%d" (int $v.ports.nixl.first) (int $v.ports.nixl.last) | quote }}
- name: UCX_TLS
  value: {{ include "tandem.ucxTls" . | quote }}
{{- with $v.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- with $v.ucx.ibGidIndex }}
- name: UCX_IB_GID_INDEX
  value: {{ . | toString | quote }}
{{- end }}
{{- range $name, $value := $v.ucx.extraEnv }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* An emptyDir with an optional sizeLimit: (dict "name" "tmp" "sizeLimit" "") */}}
{{- define "tandem.emptyDir" -}}
- name: {{ .name }}
  {{- if .sizeLimit }}
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}

{{/*
Volumes every Ray pod has: /dev/shm in memory, the scratch emptyDirs a read-only root
filesystem needs (/tmp, Ray's /tmp/ray, HOME) and, when given, the model.
(dict "ctx" $ "shmSize" "4Gi")
*/}}
{{- define "tandem.volumes" -}}
{{- $scratch := .ctx.Values.scratch -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{ include "tandem.emptyDir" (dict "name" "tmp" "sizeLimit" $scratch.tmp.sizeLimit) }}
{{/* ray-logs: the name KubeRay gives /tmp/ray, so its autoscaler sidecar mounts this one. */ -}}
{{ include "tandem.emptyDir" (dict "name" "ray-logs" "sizeLimit" $scratch.ray.sizeLimit) }}
{{ include "tandem.emptyDir" (dict "name" "home" "sizeLimit" $scratch.home.sizeLimit) }}
{{- with .ctx.Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{ include "tandem.scratchMounts" . }}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The writable scratch mounts (the autoscaler sidecar gets /tmp/ray from KubeRay). */}}
{{- define "tandem.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: ray-logs
  mountPath: /tmp/ray
- name: home
  mountPath: {{ .Values.scratch.home.mountPath }}
{{- end }}

{{/* A head probe: the chart's path on the router port, the timings from head.probes. (dict "path" "/health" "timing" .Values.head.probes.startup) */}}
{{- define "tandem.probe" -}}
httpGet:
  path: {{ .path }}
  port: http
{{ toYaml .timing }}
{{- end }}

{{/* Ray ports every node binds to fixed numbers, so the NetworkPolicy and firewalls can name them. */}}
{{- define "tandem.rayNodeStartParams" -}}
{{- $p := .Values.ray.ports }}
object-manager-port: {{ $p.objectManager | toString | quote }}
node-manager-port: {{ $p.nodeManager | toString | quote }}
min-worker-port: {{ $p.minWorkerPort | toString | quote }}
max-worker-port: {{ $p.maxWorkerPort | toString | quote }}
metrics-export-port: {{ $p.metrics | toString | quote }}
{{- end }}

{{/* rayStartParams.resources in the quoting KubeRay and Ray's autoscaler parse: '"{\"name\": n}"'. */}}
{{- define "tandem.rayResources" -}}
{{- printf "\"{\\\"%s\\\": %s}\"" .rayResource (include "tandem.poolSlots" .) }}
{{- end }}

{{/* The `tandem serve` command line the head runs after `ray start`. model.quantized adds
`--quantized`, which changes only the quantization settings left at auto (and --kv-dtype auto). */}}
{{- define "tandem.serveArgs" -}}
{{- $v := .Values -}}
tandem serve --model {{ include "tandem.modelPath" . | quote }} --served-model-name {{ include "tandem.servedModelName" . | quote }} --mode {{ $v.serving.mode }}
{{- if eq $v.serving.mode "disagg" }} --prefill {{ int $v.serving.prefill }} --decode {{ int $v.serving.decode }}
{{- else }} --replicas {{ int $v.serving.replicas }}
{{- end }} --host 0.0.0.0 --port {{ int $v.router.port }} --address auto --bind-host auto --prefill-resource {{ $v.prefill.rayResource }} --decode-resource {{ $v.decode.rayResource }} --dtype {{ $v.model.dtype }} --kv-dtype {{ $v.model.kvDtype }} --prefill-quantization {{ $v.model.prefillQuantization | default "auto" }} --decode-quantization {{ $v.model.decodeQuantization | default "auto" }}
{{- if $v.model.quantized }} --quantized{{ end }} --block-size {{ int $v.model.blockSize }}
{{- if not (kindIs "invalid" $v.serving.disaggThreshold) }} --disagg-threshold {{ int $v.serving.disaggThreshold }}{{ end }}
{{- range $v.serving.extraArgs }} {{ . | quote }}{{ end }}
{{- end }}
