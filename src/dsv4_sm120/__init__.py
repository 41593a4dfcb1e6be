"""dsv4-sm120: DeepSeek-V4-Flash on sm_120 / sm_90 with upstream SGLang, as a plugin.

Importing this package does no work: the sglang entry point calls
:func:`dsv4_sm120.plugin.register`, which checks the pin and registers hooks.
"""

__version__ = "0.1.0"
