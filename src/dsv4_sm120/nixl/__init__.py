"""NIXL prefill/decode disaggregation hardening: frame validation, tombstones, liveness."""
