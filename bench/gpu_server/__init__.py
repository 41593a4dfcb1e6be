"""Real DeepSeek-V4 sglang servers on a GPU host: ``python -m bench.gpu_server run SET`` starts them, runs a
set's scenarios and writes one record; the host is set up by the air-gap tool (``python -m tools.airgap``)."""
