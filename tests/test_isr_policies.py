"""Suspend at one site, resume at another, under every state-transfer policy, over shaped links.

Two sites, each in its own network namespace behind a veth link shaped to 100 Mbit/s each way (tbf), with
its own chunk cache and state, talk to one real isr-server. For every policy: site A resumes the parcel
(booting it), makes visible changes (a RAM-only token, a file on disk, the RAM counter), suspends and
checks in; site B resumes it with the policy, and the guest carries on exactly: the counter continues,
the token survived, the file is there. Then the guest powers off at B, B checks in, and the committed
disk image is e2fsck-clean.
"""
from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from isrctl import pack, stateroms
from parcels import parcel as parcel_ops
from parcels import resumepack, seal
from parcels.manifest import DEVSTATE, DEVSTATE_FILES, Manifest
from parcels.store import DirStore
from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import (IsrEnv, NetSite, Parcel, check_continues, isr_env, make_changes,  # noqa: F401
                                nets, sites)

pytestmark = pytest.mark.timeout(400)

POLICIES = ["baseline", "proactive", "demand", "lazy-ws", "eager-ws", "eager-writeback"]


@pytest.mark.parametrize("policy", POLICIES)
def test_guest_continues_at_the_other_site(policy: str, isr_env: IsrEnv, nets: list[NetSite],
                                           tmp_path: Path) -> None:
    parcel = isr_env.make_parcel(f"p-{policy}")
    with sites(isr_env, tmp_path, ["A", "B"], nets) as (a, b):
        # t1 at site A: boot (version 1 is powered off) and work.
        a_policy = "eager-writeback" if policy == "eager-writeback" else "demand"
        out = a.resume(parcel, "--policy", a_policy).stdout
        assert "booted cold" in out
        with a.console(parcel) as console:
            console.wait_ready(90)
            marks = make_changes(console, "site-a")
        if policy == "eager-writeback":
            status = a.stat(parcel)["session_status"]["vulpes"]["writeback"]
            assert status["trickle"] is True

        # Suspend and check in (t2).
        out = a.isr("suspend", parcel.name).stdout
        assert "committed version 2" in out, out
        print(f"[{policy}] site A suspend:\n{out}")
        # The time to the safe state counts from the command's own start, which it reports as a phase.
        safe = re.search(r"safe at this site after ([0-9.]+) s \(isr start ([0-9.]+) s,", out)
        assert safe and 0 < float(safe[2]) < float(safe[1]), out
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 2

        # t3 at site B: proactive policies warm the cache ahead of time.
        if policy == "proactive":
            out = b.isr("hoard", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
            assert "hoarding everything" in out
        elif policy == "eager-ws":
            out = b.isr("hoard", parcel.name, "--working-set", "--keyfile", str(parcel.keyfile)).stdout
            assert "hoarding the working set" in out

        # t4: resume at site B.
        out = b.resume(parcel, "--policy", policy).stdout
        assert re.search(r"version 2 resumed in [0-9.]+ s", out), out
        print(f"[{policy}] site B resume:\n{out}")
        if policy == "proactive":
            assert re.search(r"all \d+ chunks were hoarded ahead of time", out), out
        elif policy == "eager-ws":
            match = re.search(r"working set: (\d+) of (\d+) chunks hoarded ahead of time", out)
            assert match and match.group(1) == match.group(2) and int(match.group(2)) > 0, out
        elif policy == "lazy-ws":
            assert "while the guest does not wait: the working set" in out, out
            # vulpes hoards it at idle priority: only while no guest read waits.
            hoard = wait_until(lambda: (h := b.stat(parcel)["session_status"]["vulpes"]["hoard"])["chunks_total"] and h,
                               120, "the working-set hoard")
            assert hoard["priority"] == "idle", hoard
        elif policy == "baseline":
            assert "hoarding everything (baseline)" in out

        blobs = b.state_dir(parcel) / "blobs"
        if policy not in ("proactive", "eager-ws"):
            # B is a fresh site and the guest's kernel is in its memory image: no boot file crossed the link.
            assert "fetching boot file" not in out and "boot files" not in out, out
            assert not blobs.exists() or not any(blobs.iterdir()), list(blobs.iterdir())

        # t5: the guest carries on exactly where it stopped.
        with b.console(parcel) as console:
            check_continues(console, marks)
            if policy == "demand":
                # A reboot of a guest resumed without its boot files: the session boots it again with them.
                console.request_reboot()
                console.wait_ready(120)
                assert any(len(p.name) == 64 for p in blobs.iterdir()), "the boot files were not fetched"
                assert "the guest rebooted: starting it again with its boot files" in b.logs()
                assert console.check(f"md5sum {marks.file}").split()[0] == marks.digest
            more = make_changes(console, "site-b", megabytes=1)
            console.request_poweroff()
        b.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 3
        info = b.stat(parcel)
        assert info["lock"] is None and info["local"] is None

        manifest = isr_env.check_committed_disk(parcel, tmp_path)
        assert manifest.version == 3 and not manifest.suspended
        assert manifest.images["memory"].chunks == 0
        assert more.file

        # And back at A: version 3 boots cold and has both sites' files.
        a.resume(parcel)
        with a.console(parcel) as console:
            console.wait_ready(90)
            assert console.check(f"md5sum {marks.file}").split()[0] == marks.digest
            assert console.check(f"md5sum {more.file}").split()[0] == more.digest
        a.isr("suspend", parcel.name, "--no-checkin")
        a.wait_session_end(parcel)


def committed_manifest(env: IsrEnv, parcel: Parcel, version: int) -> Manifest:
    store = DirStore(env.store)
    keys = parcel_ops.unlock(store, uuid.UUID(parcel.id), keyfile=parcel.keyfile.read_bytes())
    return parcel_ops.open_version(store, uuid.UUID(parcel.id), version, keys).manifest


def stored_blob(env: IsrEnv, parcel: Parcel, version: int, name: str) -> bytes:
    return DirStore(env.store).get_blob(uuid.UUID(parcel.id), version, name)


def test_resume_pack_serves_the_next_fresh_site(isr_env: IsrEnv, nets: list[NetSite], tmp_path: Path) -> None:
    """A session that resumed makes a resume pack at suspend (REAP's record of what the guest touched first);
    the next resume at a fresh site loads it into vulpes, which serves those bytes before their chunks. Each
    suspend also lets the guest run a little more with its mapped pages dropped, and packs the pages it used
    then that its first touches lack (its recent pages); a session that booted cold packs only those.

    Every suspended version also has its device state without the firmware it carries (``devstate.fw``): a
    fresh site whose QEMU has the same firmware (B) fetches that; one with other firmware (C, whose QEMU
    firmware directories hold an altered option ROM) fetches the whole state, and both guests carry on."""
    parcel = isr_env.make_parcel("p-pack")
    with sites(isr_env, tmp_path, ["A", "B", "C"], [nets[0], nets[1], nets[0]]) as (a, b, c):
        a.resume(parcel, "--policy", "demand")
        with a.console(parcel) as console:
            console.wait_ready(90)
            marks = make_changes(console, "site-a", megabytes=1)
        out = a.isr("suspend", parcel.name).stdout
        assert "committed version 2" in out and re.search(r"recent pages [0-9.]+ s", out), out
        a.wait_session_end(parcel)
        # A booted cold: its pack is the pages the guest used at its end, found again after vulpes
        # dropped them from QEMU's mapping (each read a second time in the trace).
        manifest = committed_manifest(isr_env, parcel, 2)
        sizes = [manifest.blobs[name].size for name in pack.parts(manifest)]
        assert 0 < sum(sizes) <= pack.RECENT_BYTES + 64 * 1024, sizes
        reads = [int(line.split()[5]) // 4096 for trace in (a.state_dir(parcel) / "traces").glob("*.trace")
                 for line in trace.read_text().splitlines()[1:] if line.split()[1:2] == ["memory"]
                 and line.split()[3] == "r"]
        assert len(reads) - len(set(reads)) > 50, (len(reads), len(set(reads)))
        # QEMU saved the guest's BIOS and option ROMs with its state: sealed against this PC's copies of
        # them, the state is a small part of itself, and it is the same payload.
        manifest = committed_manifest(isr_env, parcel, 2)
        assert manifest.blobs[DEVSTATE_FILES] == manifest.blobs[DEVSTATE]
        whole, without = (stored_blob(isr_env, parcel, 2, name) for name in (DEVSTATE, DEVSTATE_FILES))
        keys = parcel_ops.unlock(DirStore(isr_env.store), uuid.UUID(parcel.id), keyfile=parcel.keyfile.read_bytes())
        firmware = seal.files_named(keys.parcel_key, without, seal.KIND_DEVSTATE)
        print(f"device state: {len(whole)} bytes sealed, {len(without)} against {firmware}")
        assert firmware and 5 * len(without) < len(whole), (len(without), len(whole), firmware)
        # The pack's parts crossed as one zstd stream (a resume reads them in order), and the version checks.
        streamed = [stored_blob(isr_env, parcel, 2, name)[6] for name in pack.parts(manifest)]
        assert streamed and set(streamed) == {seal.COMPRESSION_ZSTD_STREAM}, streamed
        assert parcel_ops.verify_version(DirStore(isr_env.store), uuid.UUID(parcel.id), 2, keys) == []

        out = b.resume(parcel, "--policy", "demand").stdout
        assert "resume pack: " in out, out
        session_log = (b.state_dir(parcel) / "session.log").read_text()
        assert f"device state: {len(without)} bytes fetched, its firmware (" in session_log, session_log
        with b.console(parcel) as console:
            check_continues(console, marks)
            marks = make_changes(console, "site-b", megabytes=1)
        out = b.isr("suspend", parcel.name).stdout
        assert "committed version 3" in out, out
        b.wait_session_end(parcel)
        # QEMU maps B's memory image from vulpes's second mount, whose readahead is off: every page fault is
        # one 4 KiB read, so the trace (and the pack made from it) names the very pages the guest touched.
        reads = [int(line.split()[6]) for trace in (b.state_dir(parcel) / "traces").glob("*.trace")
                 for line in trace.read_text().splitlines()[1:] if line.split()[1:2] == ["memory"]
                 and line.split()[3] == "r"]
        assert reads and max(reads) == 4096, sorted(set(reads))
        manifest = committed_manifest(isr_env, parcel, 3)
        size = manifest.blobs[resumepack.BLOB_NAME].size
        assert 0 < size <= 2 * pack.FIRST_PART_BYTES, size

        # C's QEMU has other firmware than B's: one byte of one of the files differs.
        other = tmp_path / "other-firmware"
        other.mkdir()
        named = seal.files_named(keys.parcel_key, stored_blob(isr_env, parcel, 3, DEVSTATE_FILES), seal.KIND_DEVSTATE)
        for name, size, digest in named:
            data = bytearray(stateroms.lookup(name, size, digest) or b"")
            assert len(data) == size, name
            (other / name).write_bytes(data)
        data[size // 2] ^= 0xFF
        (other / named[-1][0]).write_bytes(data)
        c.extra_env["ISR_QEMU_FIRMWARE_DIRS"] = str(other)
        out = c.resume(parcel, "--policy", "demand").stdout
        session_log = (c.state_dir(parcel) / "session.log").read_text()
        assert f"compressed against files this site lacks: {named[-1][0]}: fetching the whole device state" \
            in session_log, session_log
        match = re.search(r"resume pack: ([0-9.]+) MiB of memory ready before its chunks", out)
        assert match and float(match.group(1)) > 0, out
        assert re.search(r"resume pack \+ qemu start [0-9.]+ s, qemu [0-9.]+ s", out), out    # side by side
        vulpes = c.stat(parcel)["session_status"]["vulpes"]
        print(f"site C resume:\n{out}\npack {size} bytes, vulpes hits {vulpes['hits']}")
        assert vulpes["images"]["memory"]["pack_bytes"] > 0
        assert vulpes["hits"]["pack"] > 0, vulpes["hits"]
        # Every part comes, numbered, the later ones in one streamed answer; the first maps the others, and the
        # loader tells vulpes when it is done, so no read waits for a part after that.
        parts = pack.parts(manifest)
        wait_until(lambda: c.stat(parcel)["session_status"]["vulpes"]["images"]["memory"]["pack_parts"]
                   == len(parts), 60, f"all {len(parts)} pack parts in vulpes{c.logs()}")
        vulpes_log = (c.state_dir(parcel) / "vulpes.log").read_text()
        assert ("with the map of the parts to come" in vulpes_log) == (len(parts) > 1), (parts, vulpes_log)
        assert f"resume pack part {len(parts) - 1} of" in vulpes_log, vulpes_log
        with c.console(parcel) as console:
            check_continues(console, marks)
            console.request_poweroff()
        c.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 4
        assert resumepack.BLOB_NAME not in committed_manifest(isr_env, parcel, 4).blobs   # powered off
