"""Triton kernels for bf16 index keys, each with a plain torch reference.

Imports torch and triton only, never sglang: the same modules run on a Hopper GPU
host whose image has no sglang (Triton 3.6) and compile ahead of time for sm_90 and sm_120 in CI
(Triton 3.8). Modules:

- ``layout``: the bf16 C4 index-K page contract shared with the memory pool.
- ``index_k_store``: compressor output -> RMSNorm, RoPE, Hadamard -> bf16 page rows.
- ``index_query``: indexer query RoPE + Hadamard in bf16 (no fp8 quantization).
- ``mqa_logits``: paged MQA logits over bf16 pages, decode and prefill.
- ``two_stage_logits``: a two-stage selection, fp8 scan of every key then bf16 re-score of the best (not yet served).
- ``page_checksum``: per-page integrity checksum for HiCache / PD integrity mode.
- ``page_copy``: one-launch gather-copy of whole pages between device and pinned host pools.
- ``aot``: the launch signature of every kernel, compiled ahead of time for sm_90 and sm_120 in CI.
- ``launch``: eager launches without Triton's per-call host work once a specialization has run.
- ``warmup``: ``compile_for_serving``, every kernel variant a server launches, compiled before it serves.
"""
