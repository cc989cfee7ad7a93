"""Tools that study ISR rather than run it (``tools.chunksim``: the trace-driven chunk-size and policy simulator)."""
