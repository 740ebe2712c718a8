"""Measurement: `tandem bench serve` (an OpenAI-compatible load generator), request-length
traces, `tandem profile` and `tandem bench kv-transfer`. Imports engine/ and kv_transfer/
only; see README.md for the reading order."""
