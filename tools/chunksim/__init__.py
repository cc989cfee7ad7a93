"""tools.chunksim: the trace-driven chunk-size and state-transfer-policy simulator of ISR.

- `trace`: read access traces (plain CSV, vulpes' format; zstd-compressed or not) and write them.
- `cache`: demand-fetch simulation per chunk size: misses, bytes fetched, bytes fetched but never used,
  dirty chunks to upload (as the papers did with Dinero IV).
- `policy`: resume latency and slowdown of each ISR state-transfer policy for a trace, bandwidth and RTT.
- `plot`: the chunk-size figure (PNG).
- `capture`: record a trace from the real test guest under QEMU.

``python -m tools.chunksim sizes|policy|capture ...``; see doc/chunksim.md.
"""
