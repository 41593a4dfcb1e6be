"""A prefill/decode pair of the pin's real NIXL classes in one process, with no model (:mod:`.pair`), and the
abort storm on it (:mod:`.abort_storm`, ``dsv4-sm120 abort-storm``) for a machine without a cluster. It runs with
the package's hardening or, with ``--baseline``, the pin's bootstrap thread, and imports sglang and NIXL. It is not
runtime code: the fixes themselves live in ``nixl/``."""
