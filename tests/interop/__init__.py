"""Clients nobody here wrote (lm-evaluation-harness, the `openai` package) against a live
`tandem serve`: 1 prefill + 1 decode worker, disaggregated, fp32, the tiny llama."""
