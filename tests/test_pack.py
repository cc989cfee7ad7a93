"""isrctl.pack without a VM: which bytes of the memory image a trace says the guest touched first, and how
they become the extents of a resume pack (the whole path, suspend to a fresh site's resume, is in
tests/test_isr_policies.py)."""
from __future__ import annotations

from pathlib import Path

from isrctl import pack
from parcels import resumepack

LINES = """# vulpes-trace 2 chunk_size=131072
100.0 memory 3 r server 397312 32768
100.1 disk 0 r cache 0 4096
100.2 memory 3 r ram 397312 4096
100.3 memory 3 w ram 401408 4096
100.4 memory 0 r server 8192 4096
100.5 memory 9 r zero 1179648 65536
"""


def test_first_touches_take_new_memory_reads_in_order_up_to_the_limit(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    trace.write_text(LINES)
    assert pack.first_touches(trace, "memory", 1 << 20) == [(397312, 32768), (8192, 4096), (1179648, 65536)]
    # A version-3 trace (a chunk size per image) has the same lines.
    v3 = tmp_path / "v3.trace"
    v3.write_text(LINES.replace("# vulpes-trace 2 chunk_size=131072",
                                "# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=32768"))
    assert pack.first_touches(v3, "memory", 1 << 20) == [(397312, 32768), (8192, 4096), (1179648, 65536)]
    # The limit counts new pages: the first read is 8 pages, so a limit of 8 pages stops after it.
    assert pack.first_touches(trace, "memory", 8 * 4096) == [(397312, 32768)]
    assert pack.first_touches(tmp_path / "none", "memory", 1 << 20) == []
    old = tmp_path / "v1.trace"
    old.write_text("# vulpes-trace 1 chunk_size=131072\n100.0 memory 3 r server\n")
    assert pack.first_touches(old, "memory", 1 << 20) == []


def test_extents_are_sorted_page_aligned_joined_and_inside_the_image() -> None:
    # Whole pages, sorted; only pages the reads touched (a page apart stays apart: the next resume reads one
    # page per fault through the memory mount, so no neighbour is worth its bytes).
    assert pack.extents([(9000, 100), (100, 10), (20000, 5000), (60000, 10)], 61440) == \
        [(0, 4096), (8192, 4096), (16384, 12288), (57344, 4096)]
    # Touching or overlapping pages become one extent; the image's end clips the last page.
    assert pack.extents([(4096, 4096), (0, 4096), (6000, 100)], 14000) == [(0, 8192)]
    assert pack.extents([(0, 4096), (12288, 4096)], 14000) == [(0, 4096), (12288, 1712)]


def test_build_reads_the_chosen_bytes_back_from_the_memory_image(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    trace.write_text(LINES)
    memory = tmp_path / "memory"
    image = bytes(range(256)) * (2 << 20 >> 8)
    memory.write_bytes(image)
    [payload] = pack.build(trace, memory, len(image))
    got = [(e.offset, bytes(data)) for e, data in resumepack.decode(payload, len(image))]
    assert [offset for offset, _ in got] == [8192, 397312, 1179648]
    assert all(data == image[offset:offset + len(data)] for offset, data in got)
    # A first part of 32 KiB: the first touch alone fills it; the next ones go to the second...
    def part_offsets(first: int, part: int) -> list[list[int]]:
        return [[e.offset for e, _ in resumepack.decode(p, len(image))]
                for p in pack.build(trace, memory, len(image), first=first, part=part)]

    assert part_offsets(32768, 1 << 20) == [[397312], [8192, 1179648]]
    # ... and later parts of 4 KiB: one each.
    assert part_offsets(32768, 4096) == [[397312], [8192], [1179648]]
    empty = tmp_path / "empty.trace"
    empty.write_text("# vulpes-trace 2 chunk_size=131072\n")
    assert pack.build(empty, memory, len(image)) == []
