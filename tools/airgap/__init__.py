"""The air-gap tool: the pin's packages, this project's wheel and the test checkpoints for a GPU host without
network, as parts of a size an upload allows (``pack``), checked and set up there (``unpack``), rehearsed on a
CPU host first (``rehearse``), and the JIT caches carried between hosts (``cache``); ``python -m tools.airgap``."""
