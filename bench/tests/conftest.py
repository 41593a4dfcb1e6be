"""Without a CUDA device the bench's kernels run in Triton's interpreter, set before Triton is first imported
(as tests/conftest.py does for the package's own tests, when bench/tests runs alone)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
