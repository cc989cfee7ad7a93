"""tools.chunksim: the simulator's arithmetic on hand-made traces, the trace readers, the policy model, and
the command line end to end on a stored trace (the PNG it draws must be a real PNG).

Every expected number here is worked out by hand in the comments next to it.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import zstandard

from tools.chunksim.__main__ import main
from tools.chunksim.cache import ChunkCache, Ranges, simulate, sweep
from tools.chunksim.capture import data_ranges_at, parse_qemu_log, read_qemu_log, scan_data_ranges, vulpes_accesses
from tools.chunksim.errors import ChunksimError, ModelError, TraceFormatError
from tools.chunksim.policy import (POLICIES, PolicyParams, Prediction, dirty_state, predict, stored_disk_bytes, timing,
                                   with_defaults, working_set_order)
from tools.chunksim.trace import Access, Trace, read_trace, write_trace
from tools.chunksim.units import parse_bandwidth, parse_duration, parse_size

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "tools" / "chunksim" / "traces"
K = 1024


def make_trace(*records: tuple[float, int, int, str], **metadata: str) -> Trace:
    return Trace(name="hand", accesses=[Access(t, o, n, op) for t, o, n, op in records], metadata=dict(metadata))


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the demand-fetch simulation ---------------------------------------------------------------------------

def test_reads_only_miss_on_first_touch_and_count_unused_bytes() -> None:
    trace = make_trace((0, 0, 4096, "R"), (1, 4096, 4096, "R"), (2, 0, 100, "R"), (3, 70000, 10, "R"))
    # 64 KiB chunks: chunk 0 (three reads) and chunk 1 (70000 // 65536); two misses of four references.
    big = simulate(trace, 64 * K)
    assert (big.requests, big.references, big.misses, big.read_misses) == (4, 4, 2, 2)
    assert big.miss_ratio == 0.5
    assert big.bytes_fetched == 2 * 65536
    # Distinct bytes read: 0..8192 and 70000..70010 = 8202; the rest of both chunks was never used.
    assert big.distinct_bytes_read == 8202
    assert big.bytes_never_used == 131072 - 8202
    assert big.distinct_chunks == 2
    # 4 KiB chunks: chunks 0, 1, 0, 17: three misses, 12288 bytes fetched, 4086 of them never read.
    small = simulate(trace, 4 * K)
    assert (small.references, small.misses) == (4, 3)
    assert small.bytes_fetched == 12288
    assert small.bytes_never_used == 12288 - 8202
    assert small.dirty_chunks == small.upload_bytes == 0


def test_a_request_crossing_chunks_makes_one_reference_per_chunk() -> None:
    # 200 bytes at 4000 touch chunk 0 (96 bytes) and chunk 1 (104 bytes) of 4 KiB.
    result = simulate(make_trace((0, 4000, 200, "R")), 4 * K)
    assert (result.requests, result.references, result.misses) == (1, 2, 2)
    assert result.bytes_fetched == 8192
    assert result.bytes_never_used == 8192 - 200
    # One 8 KiB chunk holds it all.
    assert simulate(make_trace((0, 4000, 200, "R")), 8 * K).references == 1


def test_partial_and_whole_chunk_writes_under_both_write_policies() -> None:
    trace = make_trace((0, 0, 4096, "W"),        # covers chunk 0 whole
                       (1, 8192, 100, "W"),      # 100 bytes of chunk 2
                       (2, 0, 4096, "R"),        # reads back what the first write wrote
                       (3, 8192, 4096, "R"))     # reads chunk 2: 100 written bytes, 3996 fetched ones
    fetch = simulate(trace, 4 * K, write_policy="fetch")
    # Both writes miss and fetch. Reading written bytes is no use of the fetch: chunk 0's 4096 fetched bytes
    # are never used, chunk 2's 3996 unwritten bytes are, so 100 are not.
    assert (fetch.write_misses, fetch.read_misses, fetch.whole_chunk_writes) == (2, 0, 0)
    assert fetch.miss_ratio == 2 / 4
    assert fetch.bytes_fetched == 8192
    assert fetch.bytes_never_used == 4096 + 100
    assert (fetch.dirty_chunks, fetch.dirty_bytes, fetch.upload_bytes) == (2, 8192, 8192)
    assert fetch.distinct_bytes_written == 4196

    whole = simulate(trace, 4 * K, write_policy="whole-no-fetch")
    # The whole-chunk write needs no fetch; the partial one still does.
    assert (whole.write_misses, whole.whole_chunk_writes) == (1, 1)
    assert whole.miss_ratio == 1 / 4
    assert whole.bytes_fetched == 4096
    assert whole.bytes_never_used == 100
    assert whole.dirty_chunks == 2


def test_lru_capacity_evicts_least_recently_used_and_writes_back_dirty_chunks() -> None:
    c = 4 * K
    trace = make_trace((0, 0, c, "R"),          # miss: [0]
                       (1, c, c, "R"),          # miss: [0, 1]
                       (2, 0, 100, "W"),        # hit, dirty: [1, 0]
                       (3, 2 * c, c, "R"),      # miss, evicts 1 (clean): [0, 2]
                       (4, c, c, "R"),          # miss, evicts 0 (dirty: written back): [2, 1]
                       (5, 0, c, "R"))          # miss, evicts 2: [1, 0]
    result = simulate(trace, c, capacity=2 * c)
    assert (result.references, result.misses, result.evictions) == (6, 5, 3)
    assert result.bytes_fetched == 5 * c
    assert (result.dirty_evictions, result.bytes_written_back) == (1, c)
    # Every fetched copy was read whole before any write: nothing unused. Nothing dirty is left at the end.
    assert result.bytes_never_used == 0
    assert result.dirty_chunks == 0 and result.upload_bytes == c
    # The same trace with an infinite cache: three misses, chunk 0 dirty at the end.
    infinite = simulate(trace, c)
    assert (infinite.misses, infinite.evictions, infinite.dirty_chunks) == (3, 0, 1)
    with pytest.raises(ModelError):
        simulate(trace, c, capacity=c - 1)


def test_zero_chunks_are_filled_locally_and_the_last_chunk_is_short() -> None:
    trace = make_trace((0, 0, 100, "R"), (1, 8192, 100, "R"), data_ranges="0-4096")
    # 4 KiB: chunk 0 has data (a miss), chunk 2 has none (a zero fill, no fetch).
    small = simulate(trace, 4 * K)
    assert (small.misses, small.zero_fills, small.bytes_fetched, small.zero_aware) == (1, 1, 4096, True)
    # 16 KiB: one chunk, with data: one miss, one hit.
    assert (simulate(trace, 16 * K).misses, simulate(trace, 16 * K).zero_fills) == (1, 0)
    # Without the zero knowledge every chunk is stored.
    assert simulate(trace, 4 * K, zero_chunks=False).misses == 2
    # A 10000-byte image: its second 8 KiB chunk holds only 1808 bytes.
    short = simulate(make_trace((0, 9000, 100, "R"), image_size="10000"), 8 * K)
    assert short.bytes_fetched == 1808 and short.bytes_never_used == 1708


def test_sweep_covers_4k_to_1m_and_flags_sizes_finer_than_a_vulpes_trace(tmp_path: Path) -> None:
    path = write_text(tmp_path / "v.trace", "# vulpes-trace 1 chunk_size=131072\n"
                                            "100.5 disk 3 r server\n100.75 disk 3 w cache\n")
    rows = sweep(read_trace(path))
    assert [r.chunk_size for r in rows] == [4096 << i for i in range(9)]
    assert [r.below_trace_granularity for r in rows] == [True] * 5 + [False] * 4


def test_vulpes_writes_are_whole_only_when_vulpes_said_new(tmp_path: Path) -> None:
    path = write_text(tmp_path / "w.trace", "# vulpes-trace 1 chunk_size=131072\n"
                                            "1.0 disk 1 w new\n1.5 disk 2 w server\n")
    result = simulate(read_trace(path), 128 * K, write_policy="whole-no-fetch")
    assert (result.whole_chunk_writes, result.write_misses, result.bytes_fetched) == (1, 1, 128 * K)


def test_ranges_merge_and_report_gaps() -> None:
    r = Ranges()
    assert r.add(10, 20) == 10
    assert r.add(30, 40) == 10
    assert r.add(15, 35) == 10        # fills 20..30 only, and joins the two
    assert (r.starts, r.ends, r.total) == ([10], [40], 30)
    assert r.add(40, 45) == 5         # adjacent: merged
    assert r.gaps(0, 50) == [(0, 10), (45, 50)]
    assert r.gaps(12, 44) == []


def test_cache_install_is_a_prefetch_not_a_demand_fetch() -> None:
    cache = ChunkCache(4 * K)
    assert cache.install(("disk", 0)) and not cache.install(("disk", 0))
    assert cache.touch(Access(0, 0, 10, "R")) == []
    result = cache.result()
    assert (result.misses, result.bytes_prefetched, result.bytes_never_used) == (0, 4096, 4086)


# --- the trace readers ---------------------------------------------------------------------------------

CSV = """# workload: office
# image_size: 1048576
time_s,offset,length,op,image
0.0,0,4096,R,disk
0.5,4096,512,w,disk
0.5,0,4096,R,memory
"""


def test_csv_with_header_metadata_and_image_column(tmp_path: Path) -> None:
    trace = read_trace(write_text(tmp_path / "office.csv", CSV))
    assert trace.name == "office" and trace.format == "csv" and trace.granularity == 1
    assert trace.metadata == {"workload": "office", "image_size": "1048576"}
    assert trace.accesses[1] == Access(0.5, 4096, 512, "W", "disk")
    assert trace.images() == ["disk", "memory"]
    assert trace.duration == 0.5


def test_csv_without_header_and_zstd_compressed(tmp_path: Path) -> None:
    text = "0.0,0,4096,R\n1.25,8192,4096,W\n"
    plain = read_trace(write_text(tmp_path / "plain.csv", text))
    (tmp_path / "packed.csv.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    (tmp_path / "magic-only").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    packed = read_trace(tmp_path / "packed.csv.zst")
    assert packed.name == "packed"
    assert packed.accesses == plain.accesses == [Access(0.0, 0, 4096, "R"), Access(1.25, 8192, 4096, "W")]
    assert read_trace(tmp_path / "magic-only").accesses == plain.accesses


def test_written_traces_read_back_identically(tmp_path: Path) -> None:
    trace = read_trace(write_text(tmp_path / "t.csv", CSV))
    again = read_trace(write_trace(trace, tmp_path / "copy.csv.zst"))
    assert again.accesses == trace.accesses and again.metadata == trace.metadata


@pytest.mark.parametrize(("text", "line", "words"), [
    ("0.0,0,4096,R\n0.1,zero,4096,R\n", 2, "offset 'zero' is not a whole number"),
    ("0.0,0,4096,R\n# fine\n0.2,0,4096\n", 3, "expected 4 or 5 comma-separated fields"),
    ("0.0,0,4096,X\n", 1, "op 'X' is neither R nor W"),
    ("0.0,0,0,R\n", 1, "length 0 must be positive"),
    ("0.0,-5,10,R\n", 1, "offset -5 is negative"),
    ("1.0,0,10,R\n0.5,0,10,R\n", 2, "goes back"),
    ("soon,0,10,R\n", 1, "time 'soon' is not a number"),
    ("time_s,offset,bytes,op\n", 1, "header must be"),
    ("time_s,offset,length,op\n0.0,0,10,R,disk\n", 2, "expected 4 comma-separated fields"),
    ("# vulpes-trace 1 chunk_size=4096\n1.0 disk 7 x server\n", 2, "op 'x' is neither r nor w"),
    ("# vulpes-trace 1 chunk_size=4096\n1.0 disk 7 r\n", 2, "expected 5 space-separated fields"),
    ("# vulpes-trace 1 chunk_size=4096\n1.0 disk 7 r elsewhere\n", 2, "source 'elsewhere'"),
    ("# vulpes-trace 4 chunk_size=4096\n", 1, "unsupported vulpes trace header"),
    ("# vulpes-trace 3 chunk_size=4096\n", 1, "unsupported vulpes trace header"),
    ("# vulpes-trace 2 disk.chunk_size=4096\n", 1, "unsupported vulpes trace header"),
    ("# vulpes-trace 3 disk.chunk_size=big\n", 1, "disk.chunk_size 'big'"),
    ("# vulpes-trace 3 disk.chunk_size=0\n", 1, "must be positive"),
    ("# vulpes-trace 3 disk.chunk_size=4096\n1.0 memory 0 r ram 0 4096\n", 2, "image 'memory' has no chunk size"),
    ("# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=4096\n1.0 memory 0 r ram 4096 4096\n", 2,
     "not inside chunk 0"),
    ("# vulpes-trace 2 chunk_size=4096\n1.0 disk 7 r ram\n", 2, "expected 7 space-separated fields"),
    ("# vulpes-trace 2 chunk_size=4096\n1.0 disk 7 r ram 4096 4096\n", 2, "not inside chunk 7"),
    ("# vulpes-trace 2 chunk_size=4096\n1.0 disk 1 r ram 4096 0\n", 2, "not inside chunk 1"),
])
def test_malformed_lines_raise_an_error_naming_the_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = write_text(tmp_path / "bad.csv", text)
    with pytest.raises(TraceFormatError) as failure:
        read_trace(path)
    assert failure.value.line == line
    assert f"{path} line {line}: " in str(failure.value) and words in str(failure.value)
    assert isinstance(failure.value, ChunksimError)


def test_bad_metadata_and_bad_compression_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="data_ranges"):
        read_trace(write_text(tmp_path / "a.csv", "# data_ranges: 10-5\n0,0,1,R\n"))
    with pytest.raises(TraceFormatError, match="image_size"):
        read_trace(write_text(tmp_path / "b.csv", "# image_size: big\n0,0,1,R\n"))
    with pytest.raises(TraceFormatError, match="not zstd-compressed"):
        read_trace(write_text(tmp_path / "c.csv.zst", "0,0,1,R\n"))
    with pytest.raises(TraceFormatError, match="cannot open"):
        read_trace(tmp_path / "missing.csv")


def test_vulpes_traces_give_chunk_offsets_relative_times_and_several_runs(tmp_path: Path) -> None:
    path = write_text(tmp_path / "vulpes.trace",
                      "# vulpes-trace 1 chunk_size=131072\n"
                      "1700000000.000000 disk 2 r server\n"
                      "1700000000.250000 memory 0 w new\n"
                      "# vulpes-trace 1 chunk_size=131072\n"
                      "1700000001.000000 disk 2 r cache\n")
    trace = read_trace(path)
    assert trace.format == "vulpes" and trace.granularity == 131072
    assert trace.accesses == [Access(0.0, 262144, 131072, "R", "disk", "server"),
                              Access(0.25, 0, 131072, "W", "memory", "new"),
                              Access(1.0, 262144, 131072, "R", "disk", "cache")]


@pytest.mark.parametrize("header, memory_index", [
    ("# vulpes-trace 2 chunk_size=131072", 3),
    # Version 3: each image's chunk size (the memory image's 16 KiB: byte 397312 is in its chunk 24).
    ("# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=16384", 24)])
def test_vulpes_traces_of_version_2_and_3_give_the_bytes_touched(tmp_path: Path, header: str,
                                                                 memory_index: int) -> None:
    path = write_text(tmp_path / "v2.trace",
                      f"{header}\n"
                      f"1700000000.000000 memory {memory_index} r server 397312 4096\n"
                      "1700000000.500000 disk 0 w new 0 131072\n")
    trace = read_trace(path)
    assert trace.format == "vulpes" and trace.granularity == 1
    assert trace.accesses == [Access(0.0, 397312, 4096, "R", "memory", "server"),
                              Access(0.5, 0, 131072, "W", "disk", "new")]
    # With a version-1 run in the same file, sizes below its chunk size are beyond what it knows.
    path.write_text(path.read_text() + "# vulpes-trace 1 chunk_size=65536\n1700000001.0 disk 1 r cache\n")
    assert read_trace(path).granularity == 65536


def test_several_images_state_sizes_and_data_per_image(tmp_path: Path) -> None:
    path = write_text(tmp_path / "two.csv",
                      "# image_size.disk: 1048576\n# image_size.memory: 262144\n"
                      "# data_ranges.disk: 0-4096\n# data_ranges.memory: \n"
                      "time_s,offset,length,op,image\n0,0,4096,R,disk\n0.1,131072,4096,R,memory\n"
                      "0.2,258048,4096,W,memory\n")
    trace = read_trace(path)
    assert trace.image_size is None and trace.image_sizes() == {"disk": 1 << 20, "memory": 256 * K}
    assert trace.data_ranges() == {"disk": [(0, 4096)], "memory": []}
    # 128K chunks: disk chunk 0 has data (one miss); memory chunk 1 holds none (a zero fill, no fetch); the
    # write at 252 KiB lands in that same memory chunk: one dirty chunk of 128 KiB.
    result = simulate(trace, 128 * K, write_policy="whole-no-fetch")
    assert (result.misses, result.zero_fills, result.bytes_fetched) == (1, 1, 128 * K)
    assert result.dirty_chunks == 1 and result.upload_bytes == 128 * K
    # Both images' data and writes make the stored state: disk chunk 0 and memory chunk 1.
    assert stored_disk_bytes(trace, 128 * K) == 256 * K
    with pytest.raises(TraceFormatError, match="image_size.memory"):
        read_trace(write_text(tmp_path / "bad.csv", "# image_size.memory: lots\n0,0,1,R,memory\n"))
    with pytest.raises(TraceFormatError, match="data_ranges.disk"):
        read_trace(write_text(tmp_path / "bad2.csv", "# data_ranges.disk: 9-3\n0,0,1,R,disk\n"))


# --- capture's helpers (no QEMU needed) ------------------------------------------------------------------

def test_vulpes_records_of_one_request_merge_into_one_access(tmp_path: Path) -> None:
    path = write_text(tmp_path / "vulpes.trace",
                      "# vulpes-trace 1 chunk_size=4096\n"
                      "1000.5000 memory 10 r zero\n"
                      "1000.5001 memory 11 r zero\n"     # next chunk, same request: merged
                      "1000.5002 memory 12 w new\n"      # another op: a new access
                      "1000.5003 memory 14 w new\n"      # not adjacent: a new access
                      "1000.5004 memory 15 w ram\n"      # another source: a new access
                      "1000.9000 memory 16 w ram\n")     # adjacent but 0.4 s later: a new access
    # Times count from the mount (origin 1000.0), not from the first record.
    assert vulpes_accesses(path, origin=1000.0) == [
        Access(0.5, 40960, 8192, "R", "memory", "zero"), Access(0.5002, 49152, 4096, "W", "memory", "new"),
        Access(0.5003, 57344, 4096, "W", "memory", "new"), Access(0.5004, 61440, 4096, "W", "memory", "ram"),
        Access(0.9, 65536, 4096, "W", "memory", "ram")]


QEMU_LOG = """\
29594@1000.000100:blk_co_preadv blk 0x55 bs 0x56 offset 0 bytes 512 flags 0x0
29594@1002.000000:blk_co_preadv blk 0x55 bs 0x56 offset 1024 bytes 1024 flags 0x8
some other line QEMU printed
29594@1002.500000:blk_co_pwritev blk 0x55 bs 0x56 offset 8192 bytes 4096 flags 0x8
29594@1009.000000:blk_co_preadv blk 0x55 bs 0x56 offset 0 bytes 4096 flags 0x8
"""


def test_qemu_trace_log_lines_become_accesses_inside_the_window() -> None:
    accesses = parse_qemu_log(QEMU_LOG.splitlines(), start=1001.0, end=1005.0)
    assert accesses == [Access(1.0, 1024, 1024, "R"), Access(1.5, 8192, 4096, "W")]
    records = read_qemu_log(QEMU_LOG.splitlines())
    assert len(records) == 4
    # Data at 1005: the pristine data plus the write logged before then.
    assert data_ranges_at([(0, 4096)], records, 1005.0) == [(0, 4096), (8192, 12288)]


def test_scan_data_ranges_finds_non_zero_blocks_of_a_sparse_image(tmp_path: Path) -> None:
    image = tmp_path / "img"
    with open(image, "wb") as f:
        f.truncate(8 << 20)
        f.seek(4096)
        f.write(b"x")
        f.seek(3 << 20)
        f.write(b"\0" * 4096 + b"y" * 5000)
    assert scan_data_ranges(image) == [(4096, 8192), ((3 << 20) + 4096, (3 << 20) + 12288)]


# --- the policy model ----------------------------------------------------------------------------------

# One 128 KiB chunk per second, RTT 0.1 s: a demand fetch costs 1.1 s. Memory 2 s, disk 8 s of transfer.
PARAMS = PolicyParams(bandwidth=131072, rtt=0.1, disk_size=1 << 20, memory_size=262144, chunk_size=128 * K,
                      launch=1.0, think_gap=10.0, zero_chunks=False)


def three_reads() -> Trace:
    return make_trace((0, 0, 4096, "R"), (1, 128 * K, 4096, "R"), (2, 256 * K, 4096, "R"))


def by_policy(trace: Trace, params: PolicyParams = PARAMS) -> dict[str, Prediction]:
    return {p.policy: p for p in predict(trace, params)}


def test_policy_resume_latency_and_slowdown_by_hand() -> None:
    p = by_policy(three_reads())
    # T_local = gaps 0 + 1 + 1 = 2 s, all compute (think_gap 10 s).
    baseline = p["baseline"]
    assert baseline.local_runtime == pytest.approx(2.0)
    # baseline: rtt + (1 MiB disk + 256 KiB memory) / 128 KiB/s + launch = 0.1 + 10 + 1.
    assert baseline.resume_latency == pytest.approx(11.1) and baseline.stall == 0
    # t2: no writes, so only the memory image: 0.1 + 2.
    assert baseline.t2 == pytest.approx(2.1)
    proactive = p["proactive"]
    assert proactive.resume_latency == pytest.approx(1.0)
    assert proactive.t3 == pytest.approx(2.1) and proactive.min_travel == pytest.approx(4.2)
    demand = p["demand"]
    # t4 = 0.1 + 2 + 1; three misses at 1.1 s each.
    assert demand.resume_latency == pytest.approx(3.1)
    assert demand.stall == pytest.approx(3.3) and demand.runtime == pytest.approx(5.3)
    assert demand.slowdown == pytest.approx(1.65) and demand.slowdown_no_think == pytest.approx(1.65)
    assert (demand.demand_fetches, demand.demand_bytes) == (3, 3 * 128 * K)
    eager_ws = p["eager-ws"]
    # t3 moves the three working-set chunks and the memory image: 0.1 + 5 s. Then no misses.
    assert eager_ws.t3 == pytest.approx(5.1) and eager_ws.resume_latency == pytest.approx(1.0)
    assert eager_ws.stall == 0 and eager_ws.prefetch_bytes == 3 * 128 * K + 262144
    lazy = p["lazy-ws"]
    # At 0 nothing has streamed in: A is demand-fetched (clock 1.1). At 2.1 the stream had 2.1-0.1-1.1 = 0.9 s:
    # not enough for B, demand-fetched (clock 3.2). At 4.2 it had 4.2-0.1-2.2 = 1.9 s: C has arrived.
    assert lazy.resume_latency == pytest.approx(3.1)
    assert lazy.stall == pytest.approx(2.2) and lazy.demand_fetches == 2 and lazy.background_bytes == 128 * K
    assert p["eager-writeback"].stall == pytest.approx(3.3)


def test_short_travel_adds_the_unfinished_transfers_to_resume_latency() -> None:
    p = by_policy(three_reads(), PolicyParams(**{**PARAMS.__dict__, "travel": 3.0}))
    # pure demand only needs t2 (2.1 s) done: fits in 3 s. Fully proactive needs t2 + t3 = 4.2 s: 1.2 s late.
    assert p["demand"].resume_latency == pytest.approx(3.1)
    assert p["proactive"].resume_latency == pytest.approx(1.0 + 1.2)


def test_eager_writeback_leaves_only_recent_writes_for_t2() -> None:
    c = 128 * K
    trace = make_trace((0, 0, 10, "W"), (0, c, 10, "W"), (20, 0, 10, "W"), (25, 2 * c, 10, "R"))
    params = PolicyParams(**{**PARAMS.__dict__, "writeback_delay": 10.0})
    # chunk 0 written at 0 and 20: pushed once (quiet 20 s), still owed at the end (5 s < 10 s);
    # chunk 1 written at 0: pushed (quiet 25 s). Dirty: 2 chunks; owed: 1; pushed: 2.
    assert dirty_state(trace, params) == (2 * c, c, 2 * c)
    p = by_policy(trace, params)
    assert p["demand"].t2 == pytest.approx(0.1 + (2 * c + 262144) / 131072)    # 4.1
    assert p["eager-writeback"].t2 == pytest.approx(0.1 + (c + 262144) / 131072)    # 3.1
    assert p["eager-writeback"].upload_bytes_t1 == 2 * c


def test_policy_names_are_the_ones_isr_resume_takes() -> None:
    from isrctl.policy import POLICIES as ISR_POLICIES
    assert set(POLICIES) == set(ISR_POLICIES)


def test_the_working_set_is_every_touched_chunk_with_data_in_first_touch_order() -> None:
    c = 128 * K
    trace = make_trace((0, 3 * c, 10, "W"), (1, 0, 10, "R"), (2, 5 * c, 10, "R"), (3, 3 * c, 10, "R"),
                       data_ranges=f"0-{4 * c}")
    # Chunks 3, 0, 5, 3: chunk 3 is touched twice, chunk 5 holds no data (left out once that is known).
    assert working_set_order(trace, PARAMS) == [("disk", 3), ("disk", 0), ("disk", 5)]
    zero_aware = PolicyParams(**{**PARAMS.__dict__, "zero_chunks": True})
    assert working_set_order(trace, zero_aware) == [("disk", 3), ("disk", 0)]


def test_think_gaps_are_kept_and_compute_gaps_scaled() -> None:
    trace = make_trace((0, 0, 1, "R"), (0.2, 0, 1, "R"), (5.2, 0, 1, "R"))
    t = timing(trace, PolicyParams(**{**PARAMS.__dict__, "think_gap": 1.0, "compute_scale": 0.5}))
    assert t.gaps == pytest.approx([0.0, 0.1, 5.0])
    assert t.local_runtime == pytest.approx(5.1) and t.compute == pytest.approx(0.1)


def test_policy_parameters_are_validated_and_stored_size_comes_from_the_trace() -> None:
    with pytest.raises(ModelError):
        PolicyParams(bandwidth=0, rtt=0.1, disk_size=1)
    with pytest.raises(ModelError, match="unknown policy"):
        predict(three_reads(), PARAMS, policies=["teleport"])
    trace = make_trace((0, 300 * K, 10, "W"), data_ranges="0-4096", image_size="1048576")
    # Chunk 0 has data, chunk 2 is written: two 128 KiB chunks are stored.
    assert stored_disk_bytes(trace, 128 * K) == 256 * K
    assert with_defaults(trace, bandwidth=1e6, rtt=0.0).disk_size == 256 * K
    assert with_defaults(trace, bandwidth=1e6, rtt=0.0, zero_chunks=False).disk_size == 1 << 20


def test_units() -> None:
    assert parse_size("128K") == 131072 and parse_size("1MiB") == 1 << 20 and parse_size("4096") == 4096
    assert parse_bandwidth("10M") == 1.25e6 and parse_bandwidth("10Mbit") == 1.25e6
    assert parse_bandwidth("1.25MB/s") == 1.25e6 and parse_bandwidth("100K") == 12500
    assert parse_duration("50ms") == pytest.approx(0.05) and parse_duration("2") == 2.0
    for bad in (lambda: parse_size("lots"), lambda: parse_bandwidth("fast"), lambda: parse_duration("-1s")):
        with pytest.raises(ModelError):
            bad()


# --- the stored traces and the command line ------------------------------------------------------------

def test_stored_traces_parse_and_cover_the_workloads() -> None:
    paths = sorted(TRACES.glob("*.csv.zst"))
    workloads = {}
    for path in paths:
        assert path.stat().st_size < 1 << 20, f"{path.name} is not small"
        trace = read_trace(path)
        workloads[trace.metadata.get("workload")] = trace
        assert trace.accesses, path
        assert trace.metadata["guest"].startswith("big-")
        sizes = trace.image_sizes()
        assert sizes["disk"] == 1 << 30 and trace.data_ranges() is not None
        assert all(a.end <= sizes[a.image] for a in trace.accesses)
    assert {"boot", "office", "rsd"} <= set(workloads)
    assert all(any(a.op == "W" for a in workloads[w].accesses) for w in ("office", "rsd"))
    # The boot went through vulpes: its RAM (the memory image, all zero at the start) dominates.
    boot = workloads["boot"]
    assert boot.images() == ["disk", "memory"] and boot.data_ranges()["memory"] == []  # type: ignore[index]
    assert sum(a.length for a in boot.accesses if a.image == "memory" and a.op == "R") > 32 << 20
    assert sum(a.length for a in boot.accesses if a.image == "memory" and a.op == "W") > 32 << 20


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    crc = struct.unpack(">I", data[29:33])[0]
    assert zlib.crc32(data[12:29]) == crc, "IHDR checksum"
    assert data[-8:-4] == b"IEND", "PNG does not end with IEND"
    return struct.unpack(">II", data[16:24])


def test_cli_sizes_draws_a_png_and_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "figure.png"
    traces = [str(p) for p in sorted(TRACES.glob("*.csv.zst"))]
    assert main(["sizes", *traces, "--png", str(png), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    office = report["traces"]["office"]["results"]["fetch"]
    assert [row["chunk_size"] for row in office] == [4096 << i for i in range(9)]
    assert all(0 <= row["miss_ratio"] <= 1 for row in office)
    width, height = _png_size(png.read_bytes())
    assert width > 600 and height > 300
    assert office[0]["zero_aware"] is False          # the papers' model by default: every chunk stored
    # --isr: whole-chunk writes need no fetch and all-zero chunks are not fetched, so rsd, which writes a
    # freshly made file system, fetches far less.
    assert main(["sizes", str(TRACES / "rsd.csv.zst"), "--isr", "--json"]) == 0
    isr = json.loads(capsys.readouterr().out)["traces"]["rsd"]["results"]["whole-no-fetch"]
    papers = report["traces"]["rsd"]["results"]["fetch"]
    assert isr[5]["zero_aware"] is True and isr[5]["chunk_size"] == 128 * K
    assert isr[5]["bytes_fetched"] < papers[5]["bytes_fetched"] / 4


def test_cli_end_to_end_in_a_subprocess(tmp_path: Path) -> None:
    png = tmp_path / "rsd.png"
    trace = TRACES / "rsd.csv.zst"
    run = subprocess.run([sys.executable, "-m", "tools.chunksim", "sizes", str(trace), "--png", str(png),
                          "--write-policy", "both"], cwd=REPO, capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr
    assert "whole-no-fetch" in run.stdout and "miss ratio" in run.stdout and "128K" in run.stdout
    _png_size(png.read_bytes())
    run = subprocess.run([sys.executable, "-m", "tools.chunksim", "policy", str(trace), "--bandwidth", "10M",
                          "--rtt", "50ms", "--memory-size", "64M", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr
    predictions = {p["policy"]: p for p in json.loads(run.stdout)["predictions"]}
    assert set(predictions) == {"baseline", "proactive", "demand", "eager-ws",
                                "lazy-ws", "eager-writeback"}
    assert predictions["proactive"]["resume_latency"] < predictions["demand"]["resume_latency"] \
        < predictions["baseline"]["resume_latency"]
    assert predictions["demand"]["slowdown"] >= predictions["lazy-ws"]["slowdown"] >= 0


def test_cli_reports_a_bad_trace_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_text(tmp_path / "bad.csv", "0,0,10,R\n0,0,ten,R\n")
    assert main(["sizes", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad} line 2: length 'ten' is not a whole number" in err
    assert main(["policy", str(bad), "--bandwidth", "fast", "--rtt", "1ms"]) == 1
