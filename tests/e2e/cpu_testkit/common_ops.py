"""Stand-in for sgl_kernel's compiled ``common_ops`` on a CPU-only test machine (test infrastructure).

The installed sglang-kernel wheel is a CUDA build: loading its ``common_ops``
needs ``libcuda.so.1``, and its loader's last fallback is a plain
``import common_ops`` (``sgl_kernel/load_utils.py`` ~L192, sglang-kernel 0.4.10).
This module is that fallback. It registers, in plain torch, only the
``sgl_kernel`` ops the CPU engine calls while serving the tiny Llama; it leaves
out ``convert_weight_packed`` on purpose, so sglang's AMX backend stays off and
layers run their torch-native code.
"""
