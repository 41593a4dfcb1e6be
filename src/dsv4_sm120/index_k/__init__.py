"""bf16 index keys: device pool, planner sizing, PD layout tag, HiCache host mirror."""
