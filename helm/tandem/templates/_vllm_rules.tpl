{{/*
Recording rules that republish the router's metrics (router/metrics.py) under the names vLLM's
/metrics uses, so dashboards and autoscaling rules written for vLLM read tandem unchanged.
Shipped by vllm-rules.yaml as a PrometheusRule and/or a plain rules file in a ConfigMap.

Each rule renames one series and adds model_name; every other label (pod, worker, role, le)
is kept, so each recorded series follows exactly one scraped series and counter resets stay
visible to rate(). Summing across series here would hide a restart's reset.

Mapping notes:
- per-worker gauges keep their worker and role labels: sum by (role) gives a pool's numbers;
- vLLM emits time_per_output_token_seconds and inter_token_latency_seconds as the same
  per-token gaps (the first a deprecated alias), so both come from tandem_itl_seconds; vLLM's
  per-request mean, request_time_per_output_token_seconds, comes from tandem_tpot_seconds;
- request_success_total's label is finished_reason in vLLM, finish_reason in tandem.
*/}}

{{/* The label matchers picking this release's router series (no braces). */}}
{{- define "tandem.vllmSelector" -}}
{{- $r := .Values.metrics.vllmRecordingRules -}}
{{- if $r.selector }}{{ $r.selector }}
{{- else }}{{ printf "namespace=%q,service=%q" .Release.Namespace (printf "%s-router" (include "tandem.fullname" .)) }}
{{- end }}
{{- end }}

{{/* One recording rule: (dict "record" NAME "expr" PROMQL "model" MODEL). */}}
{{- define "tandem.vllmRule" -}}
- record: {{ .record }}
  expr: {{ .expr | toJson }}
  labels:
    model_name: {{ .model | toJson }}
{{- end }}

{{/* The rule groups, a YAML list: spec.groups of a PrometheusRule, groups: of a rules file. */}}
{{- define "tandem.vllmRuleGroups" -}}
{{- $s := include "tandem.vllmSelector" . -}}
{{- $m := include "tandem.servedModelName" . -}}
{{- $r := .Values.metrics.vllmRecordingRules -}}
{{- /* vLLM name <- tandem series, for gauges and counters renamed one to one. */ -}}
{{- $renames := list
  (list "vllm:num_requests_running" "tandem_running_requests")
  (list "vllm:num_requests_waiting" "tandem_queue_depth")
  (list "vllm:kv_cache_usage_perc" "tandem_kv_usage_ratio")
  (list "vllm:gpu_cache_usage_perc" "tandem_kv_usage_ratio")
  (list "vllm:prompt_tokens_total" "tandem_prompt_tokens_total")
  (list "vllm:generation_tokens_total" "tandem_generation_tokens_total")
  (list "vllm:prefix_cache_queries_total" "tandem_prefix_cache_query_tokens_total")
  (list "vllm:prefix_cache_hits_total" "tandem_prefix_cache_hit_tokens_total")
  (list "vllm:num_preemptions_total" "tandem_preemptions_total")
-}}
{{- $histograms := list
  (list "vllm:time_to_first_token_seconds" "tandem_ttft_seconds")
  (list "vllm:inter_token_latency_seconds" "tandem_itl_seconds")
  (list "vllm:time_per_output_token_seconds" "tandem_itl_seconds")
  (list "vllm:request_time_per_output_token_seconds" "tandem_tpot_seconds")
  (list "vllm:e2e_request_latency_seconds" "tandem_e2e_seconds")
-}}
- name: tandem.vllm-compat
  {{- with $r.interval }}
  interval: {{ . }}
  {{- end }}
  rules:
{{- range $renames }}
{{ include "tandem.vllmRule" (dict "record" (index . 0) "expr" (printf "%s{%s}" (index . 1) $s) "model" $m) | indent 4 }}
{{- end }}
{{- range $histograms }}
{{- $vllm := index . 0 }}
{{- $tandem := index . 1 }}
{{- range $suffix := list "_bucket" "_sum" "_count" }}
{{ include "tandem.vllmRule" (dict "record" (printf "%s%s" $vllm $suffix) "expr" (printf "%s%s{%s}" $tandem $suffix $s) "model" $m) | indent 4 }}
{{- end }}
{{- end }}
{{- $success := printf `sum without (finish_reason) (label_replace(tandem_requests_finished_total{%s}, "finished_reason", "$1", "finish_reason", "(.*)"))` $s }}
{{ include "tandem.vllmRule" (dict "record" "vllm:request_success_total" "expr" $success "model" $m) | indent 4 }}
{{- end }}
