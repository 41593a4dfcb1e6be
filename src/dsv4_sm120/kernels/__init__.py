"""Triton kernels for bf16 index keys with torch references. Imports torch and triton only, never sglang."""
