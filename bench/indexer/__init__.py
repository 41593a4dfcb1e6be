"""The bf16 indexer kernels against upstream's fp8 kernels on one GPU: ``python -m bench.indexer`` (``__main__``
says what each mode runs and writes). One module a question: ``decode``, ``prefill``, ``checks``, ``eager``,
``tune``; the inputs they share in ``cases``, upstream's kernels in ``peers``, the side-by-side timing in
``paired``. ``precision`` runs on its own, on the CPU (``python -m bench.indexer.precision``): the top-512 recall
of bf16 and fp8 index keys, and the margin a two-stage indexer would need."""
