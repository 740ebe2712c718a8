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

{{/* GPUs (ranks) of one worker of a pool, serving.prefillTp / serving.decodeTp:
(dict "ctx" $ "pool" "prefill"). */}}
{{- define "tandem.poolTp" -}}
{{- int (index .ctx.Values.serving (printf "%sTp" .pool)) }}
{{- end }}

{{/* Workers of a pool one pod holds: a TP group is packed on one pod (STRICT_PACK), so a pod
of S units holds S / TP of them, rounded down: (dict "ctx" $ "pool" "prefill"). */}}
{{- define "tandem.poolWorkersPerPod" -}}
{{- $g := index .ctx.Values .pool }}
{{- div (int (include "tandem.poolSlots" $g)) (int (include "tandem.poolTp" .)) }}
{{- end }}

{{/*
Checks JSON schema cannot express (it does not compare two values). Each message names the
keys to change.
*/}}
{{- define "tandem.validate" -}}
{{- $v := .Values }}
{{- include "tandem.modelPath" . }}
{{- if eq $v.serving.mode "disagg" }}
{{- range $pool := list "prefill" "decode" }}
{{- $g := index $v $pool }}
{{- $tp := int (include "tandem.poolTp" (dict "ctx" $ "pool" $pool)) }}
{{- if gt $tp (int (include "tandem.poolSlots" $g)) }}
{{- fail (printf "serving.%sTp (%d) is more than a %s pod has (%s.gpusPerPod, or cpuSlots on CPU: %s): a worker's ranks are packed on one pod" $pool $tp $pool $pool (include "tandem.poolSlots" $g)) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* With the planner the groups' counts come from its bounds (tandem.groupReplicas). */}}
{{- if not $v.autoscaling.planner.enabled }}
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
{{- $cap := mul (int $g.maxReplicas) (int (include "tandem.poolWorkersPerPod" (dict "ctx" $ "pool" $pool))) }}
{{- if gt (int (index $v.serving $pool)) $cap }}
{{- fail (printf "serving.%s (%d actors) exceeds what %s.maxReplicas x slots per pod can hold (%d) with serving.%sTp %d: a pod of %s slots holds slots / TP workers" $pool (int (index $v.serving $pool)) $pool $cap $pool (int (include "tandem.poolTp" (dict "ctx" $ "pool" $pool))) (include "tandem.poolSlots" $g)) }}
{{- end }}
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
{{- if $v.autoscaling.planner.enabled }}
{{- include "tandem.validatePlanner" . }}
{{- end }}
{{- end }}

{{/* The planner's checks (autoscaling.planner.enabled): what it needs around it, its bounds
and its capacity profile. */}}
{{- define "tandem.validatePlanner" -}}
{{- $v := .Values }}
{{- $p := $v.autoscaling.planner }}
{{- if not $v.autoscaling.enabled }}
{{- fail "autoscaling.planner.enabled needs autoscaling.enabled: Ray's autoscaler adds the pods the planner's new actors wait for, and removes the ones it drained" }}
{{- end }}
{{- if ne $v.serving.mode "disagg" }}
{{- fail (printf "autoscaling.planner sizes the prefill and decode pools: it needs serving.mode disagg, not %s" $v.serving.mode) }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $lo := int (index $p (printf "min%s" (title $pool))) }}
{{- $hi := int (index $p (printf "max%s" (title $pool))) }}
{{- if gt $lo $hi }}
{{- fail (printf "autoscaling.planner.min%s (%d) must be <= autoscaling.planner.max%s (%d)" (title $pool) $lo (title $pool) $hi) }}
{{- end }}
{{- $n := int (index $v.serving $pool) }}
{{- if or (lt $n $lo) (gt $n $hi) }}
{{- fail (printf "serving.%s (%d actors to start with) must lie between autoscaling.planner.min%s (%d) and max%s (%d)" $pool $n (title $pool) $lo (title $pool) $hi) }}
{{- end }}
{{- end }}
{{- if not (kindIs "invalid" $p.gpuBudget) }}
{{- $ptp := int $v.serving.prefillTp }}
{{- $dtp := int $v.serving.decodeTp }}
{{- $floor := add (mul (int $p.minPrefill) $ptp) (mul (int $p.minDecode) $dtp) }}
{{- if lt (int $p.gpuBudget) $floor }}
{{- fail (printf "autoscaling.planner.gpuBudget (%d) is below what the minimum pools hold: minPrefill x prefillTp + minDecode x decodeTp = %d x %d + %d x %d = %d GPUs" (int $p.gpuBudget) (int $p.minPrefill) $ptp (int $p.minDecode) $dtp $floor) }}
{{- end }}
{{- end }}
{{- $cp := $p.capacityProfile }}
{{- if eq (empty $cp.json) (empty $cp.existingConfigMap) }}
{{- fail "autoscaling.planner needs exactly one capacity profile: autoscaling.planner.capacityProfile.json (e.g. --set-file autoscaling.planner.capacityProfile.json=capacity.json) or autoscaling.planner.capacityProfile.existingConfigMap" }}
{{- end }}
{{- if $cp.json }}
{{- $parsed := fromJson $cp.json }}
{{- if or (hasKey $parsed "Error") (not (hasKey $parsed "prefill_points")) }}
{{- fail "autoscaling.planner.capacityProfile.json is not a capacity profile: a JSON object as `tandem profile --capacity` or `tandem plan --out` writes it (with prefill_points)" }}
{{- end }}
{{- end }}
{{- $dir := trimSuffix "/" $cp.mountPath }}
{{- if not $dir }}
{{- fail "autoscaling.planner.capacityProfile.mountPath must not be /: name a directory of its own" }}
{{- end }}
{{- range $taken := list "/tmp" "/dev/shm" (trimSuffix "/" $v.model.mountPath) (trimSuffix "/" $v.scratch.home.mountPath) }}
{{- if or (eq $dir $taken) (hasPrefix (printf "%s/" $taken) $dir) }}
{{- fail (printf "autoscaling.planner.capacityProfile.mountPath (%s) must not lie in %s, which is mounted already" $cp.mountPath $taken) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A worker group's pod counts as YAML (replicas, minReplicas, maxReplicas):
(dict "ctx" $ "pool" "prefill"). Without the planner, the pool's own values. With it, its
actor bounds over the units of the pool's Ray resource a pod holds, rounded up, so Ray's
autoscaler can place every actor the planner may start and keeps the pods its minimum needs;
replicas start with room for serving.<pool> actors.
*/}}
{{- define "tandem.groupReplicas" -}}
{{- $v := .ctx.Values }}
{{- $g := index $v .pool }}
{{- if $v.autoscaling.planner.enabled }}
{{- $p := $v.autoscaling.planner }}
{{- $slots := max 1 (int (include "tandem.poolWorkersPerPod" .)) }}
{{- $min := div (add (int (index $p (printf "min%s" (title .pool)))) (sub $slots 1)) $slots }}
{{- $max := div (add (int (index $p (printf "max%s" (title .pool)))) (sub $slots 1)) $slots }}
{{- $start := div (add (int (index $v.serving .pool)) (sub $slots 1)) $slots }}
replicas: {{ max $min $start }}
minReplicas: {{ $min }}
maxReplicas: {{ $max }}
{{- else }}
replicas: {{ int $g.replicas }}
minReplicas: {{ int $g.minReplicas }}
maxReplicas: {{ int $g.maxReplicas }}
{{- end }}
{{- end }}

{{/* The capacity profile's ConfigMap: the chart's, or autoscaling.planner.capacityProfile.existingConfigMap. */}}
{{- define "tandem.capacityProfileConfigMap" -}}
{{- default (printf "%s-capacity-profile" (include "tandem.fullname" .)) .Values.autoscaling.planner.capacityProfile.existingConfigMap }}
{{- end }}

{{/* Where the head container reads the capacity profile (`--capacity-profile`). */}}
{{- define "tandem.capacityProfilePath" -}}
{{- $cp := .Values.autoscaling.planner.capacityProfile }}
{{- printf "%s/%s" (trimSuffix "/" $cp.mountPath) $cp.key }}
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
{{- if eq $v.serving.mode "disagg" }} --prefill {{ int $v.serving.prefill }} --decode {{ int $v.serving.decode }} --prefill-tp {{ int $v.serving.prefillTp }} --decode-tp {{ int $v.serving.decodeTp }}
{{- else }} --replicas {{ int $v.serving.replicas }} --tp {{ int $v.serving.tp }}
{{- end }} --host 0.0.0.0 --port {{ int $v.router.port }} --address auto --bind-host auto --prefill-resource {{ $v.prefill.rayResource }} --decode-resource {{ $v.decode.rayResource }} --dtype {{ $v.model.dtype }} --kv-dtype {{ $v.model.kvDtype }} --prefill-quantization {{ $v.model.prefillQuantization | default "auto" }} --decode-quantization {{ $v.model.decodeQuantization | default "auto" }}
{{- if $v.model.quantized }} --quantized{{ end }} --block-size {{ int $v.model.blockSize }}
{{- if $v.model.kvHostCacheGb }} --kv-host-cache-gb {{ $v.model.kvHostCacheGb }}{{ end }}
{{- if not (kindIs "invalid" $v.serving.disaggThreshold) }} --disagg-threshold {{ int $v.serving.disaggThreshold }}{{ end }}
{{- if $v.autoscaling.planner.enabled }} {{ include "tandem.plannerArgs" . }}{{ end }}
{{- range $v.serving.extraArgs }} {{ . | quote }}{{ end }}
{{- end }}

{{/* The planner's `tandem serve` flags (autoscaling.planner); a null value leaves tandem's
default. */}}
{{- define "tandem.plannerArgs" -}}
{{- $p := .Values.autoscaling.planner -}}
--autoscale --capacity-profile {{ include "tandem.capacityProfilePath" . | quote }} --slo-ttft-ms {{ $p.sloTtftMs }} --slo-ttft-ms-per-1k {{ $p.sloTtftMsPer1k }} --slo-tpot-ms {{ $p.sloTpotMs }} --interval-s {{ $p.intervalS }} --min-prefill {{ int $p.minPrefill }} --max-prefill {{ int $p.maxPrefill }} --min-decode {{ int $p.minDecode }} --max-decode {{ int $p.maxDecode }}
{{- if not (kindIs "invalid" $p.gpuBudget) }} --gpu-budget {{ int $p.gpuBudget }}{{ end }}
{{- if not (kindIs "invalid" $p.startupS) }} --startup-s {{ $p.startupS }}{{ end }}
{{- if not (kindIs "invalid" $p.downCooldownS) }} --down-cooldown-s {{ $p.downCooldownS }}{{ end }}
{{- end }}
