"""Real DeepSeek-V4 sglang servers on a GPU host without network access: ``pack`` the pin's packages on a
networked host, carry the parts over, ``unpack`` them there, ``run`` the scenarios; ``python -m bench.gpu_server``."""
