"""The test guest and the QEMU driver, for real: TCG QEMU booting the Debian cloud kernel.

Covers: the workload's result against the value computed on the host, the RAM counter, disk persistence
across a guest reboot and a power-off (with e2fsck clean afterwards), and suspend/resume both with RAM in
the migration stream (zstd file) and with RAM in a shared memory-backend file (x-ignore-shared).
"""
from __future__ import annotations

import base64
import re
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from isrctl.errors import IsrError, VMError, VMLaunchError
from isrctl.qemu import VM, VMConfig
from tools.guest import GuestArtifacts, GuestConsole, booted_guest, check_ext4, guest_config, resumed_guest
from tests.guest_fixtures import guest_artifacts, guest_disk, wait_until  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.timeout(180)

BOOT_LIMIT = 60.0


def _counter_passes(console: GuestConsole, value: int) -> Callable[[], int | None]:
    """A probe for wait_until: the guest's RAM counter, once it is above ``value`` (>= 0)."""
    def probe() -> int | None:
        now = console.counter()
        return now if now > value else None
    return probe


def _assert_clean(disk: Path) -> None:
    status, output = check_ext4(disk)
    assert status == 0, f"e2fsck -fn {disk} found problems (exit {status}):\n{output}"


def test_workload_result_and_counter(guest_artifacts: GuestArtifacts, guest_disk: Path, tmp_path: Path) -> None:
    with booted_guest(guest_artifacts, guest_disk, run_dir=tmp_path, ready_timeout=BOOT_LIMIT) as guest:
        console = guest.console
        first = console.counter()
        wait_until(_counter_passes(console, first), 10, "the RAM counter to advance")

        result = console.run_workload(timeout=120)
        expected = guest_artifacts.expected
        assert int(result["files"]) == expected.files
        assert int(result["matches"]) == expected.matches
        assert result["digest"] == expected.digest
        assert int(result["deleted"]) == expected.deleted

        # Repeatable: a second run in the same guest reports the same digest.
        assert console.run_workload(timeout=120)["digest"] == expected.digest

        # The agent reports exit status and output (stdout and stderr) exactly.
        assert console.run("printf 'a\\nb'; echo oops >&2; exit 7") == (7, "a\nboops\n")


def test_files_persist_across_reboot_and_poweroff(guest_artifacts: GuestArtifacts, guest_disk: Path,
                                                  tmp_path: Path) -> None:
    text = secrets.token_hex(8)
    with booted_guest(guest_artifacts, guest_disk, run_dir=tmp_path, name="first") as guest:
        guest.console.check(f"echo {text} >/data/persist-1 && sync")
        guest.console.request_reboot()
        guest.console.wait_ready(BOOT_LIMIT)
        assert guest.console.check("cat /data/persist-1").strip() == text
        guest.console.check(f"echo {text}-2 >/data/persist-2")
        guest.console.request_poweroff()
        assert guest.vm.wait(60) == 0
    _assert_clean(guest_disk)

    with booted_guest(guest_artifacts, guest_disk, run_dir=tmp_path, name="second") as guest:
        assert guest.console.check("cat /data/persist-1 /data/persist-2").split() == [text, f"{text}-2"]
        guest.console.request_poweroff()
        assert guest.vm.wait(60) == 0
    _assert_clean(guest_disk)


@pytest.mark.parametrize("ram_in_file", [False, True], ids=["ram-in-stream", "ram-in-shared-file"])
def test_suspend_resume(guest_artifacts: GuestArtifacts, guest_disk: Path, tmp_path: Path,
                        ram_in_file: bool) -> None:
    overrides: dict[str, Any] = {"memory_file": tmp_path / "ram.img"} if ram_in_file else {}
    state = tmp_path / "state.zst"

    with booted_guest(guest_artifacts, guest_disk, run_dir=tmp_path, name="before", **overrides) as guest:
        console = guest.console
        token = console.set_token()
        console.check("echo written-before-suspend >/data/before && sync")
        wait_until(_counter_passes(console, 1), 10, "the RAM counter to reach 2")
        before = console.counter()
        saved = guest.vm.save_state(state)
        assert guest.vm.query_status() == "postmigrate"
        assert guest.vm.shutdown() == 0
    assert saved.file_bytes is not None and state.stat().st_size == saved.file_bytes
    if ram_in_file:
        # RAM stayed in the file: the stream holds only device state (~100 KB, well under a MiB).
        assert (tmp_path / "ram.img").stat().st_size == 256 << 20
        assert saved.file_bytes < 1 << 20, saved
    else:
        assert 0 < saved.file_bytes < 64 << 20, saved

    with resumed_guest(guest_artifacts, guest_disk, state, run_dir=tmp_path, name="after", **overrides) as resumed:
        console = resumed.console
        after = console.counter()
        assert after >= before, f"counter went back from {before} to {after}: the guest restarted"
        assert console.token() == token, "the RAM-only token did not survive"
        wait_until(_counter_passes(console, after), 10, "the counter to keep counting after resume")
        assert console.check("cat /data/before").strip() == "written-before-suspend"
        console.check("echo written-after-resume >/data/after")
        # A resumed guest never boots: no kernel banner, no second ready marker on its console.
        assert not re.search(r"ISR-GUEST-READY|Linux version", console.transcript())
        console.request_poweroff()
        assert resumed.vm.wait(60) == 0
    _assert_clean(guest_disk)


def test_ram_in_a_file_is_not_marked_for_huge_pages(tmp_path: Path) -> None:
    """QEMU's madvise(MADV_HUGEPAGE) on guest RAM is filtered out when RAM is in a file: on a huge-page
    mapping every fault would read 4 MiB of vulpes's memory image (isrctl/seccomp.py, `no_hugepage_filter`)."""
    ram = tmp_path / "ram.img"
    with VM(VMConfig(memory_file=ram, memory_mib=64), run_dir=tmp_path, name="hg") as vm:
        vm.launch(paused=True)
        assert vm.pid is not None
        flags, mapped = None, ""
        for line in Path(f"/proc/{vm.pid}/smaps").read_text().splitlines():
            fields = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):
                mapped = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "VmFlags:" and mapped == str(ram):
                flags = fields[1:]
        assert flags is not None, f"QEMU has not mapped {ram}"
        assert "sh" in flags and "hg" not in flags, flags


def test_failed_launch_reports_exit_code_command_and_output(tmp_path: Path) -> None:
    config = VMConfig(kernel=tmp_path / "no-such-kernel")
    with VM(config, run_dir=tmp_path) as vm:
        with pytest.raises(VMLaunchError) as failure:
            vm.launch(timeout=20)
    error = failure.value
    assert isinstance(error, IsrError)
    assert error.exitcode == 1
    assert str(tmp_path / "no-such-kernel") in error.command
    assert "no-such-kernel" in error.output
    assert not vm.is_running()


@pytest.mark.parametrize("fields", [{"machine": "q35"}, {"cpu": "host"}, {"disk_cache": "fast"},
                                    {"disk_aio": "native", "disk_cache": "writeback"}, {"accel": "hvf"}])
def test_config_rejects_unportable_or_invalid_settings(fields: dict[str, str]) -> None:
    with pytest.raises(VMError):
        VMConfig(**fields)  # type: ignore[arg-type]


def test_guest_config_pins_the_virtual_hardware(guest_artifacts: GuestArtifacts, guest_disk: Path) -> None:
    args = guest_config(guest_artifacts, guest_disk).command_line(qmp_socket=Path("/q"), serial_socket=Path("/s"))
    joined = " ".join(args)
    for expected in ("-machine pc-q35-7.2", "-cpu qemu64", "-m 256", "-smp 1", "-accel tcg", "-nodefaults",
                     "virtio-blk-pci", "console=ttyS0"):
        assert expected in joined


def test_suspend_resume_through_memory_leaves_no_state_file(guest_artifacts: GuestArtifacts, guest_disk: Path,
                                                            tmp_path: Path) -> None:
    """The device state can go QEMU -> pipe -> this process -> pipe -> QEMU, so that isrctl can seal it
    before it is stored anywhere: no plaintext VM state on a disk. RAM lives in a shared file here, as in
    ISR's design, so the stream is device state only."""
    ram = tmp_path / "ram.img"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with booted_guest(guest_artifacts, guest_disk, run_dir=run_dir, name="before", memory_file=ram) as guest:
        token = guest.console.set_token()
        wait_until(_counter_passes(guest.console, 1), 10, "the RAM counter to reach 2")
        before = guest.console.counter()
        state, saved = guest.vm.save_state_bytes()
        assert guest.vm.query_status() == "postmigrate"
        assert guest.vm.shutdown() == 0
    assert 0 < len(state) < 1 << 20, saved
    assert saved.stream_bytes > 0
    # Nothing but QEMU's and the console's logs was written next to the VM.
    assert sorted(p.suffix for p in run_dir.iterdir()) == [".log", ".log"], list(run_dir.iterdir())

    with resumed_guest(guest_artifacts, guest_disk, state, run_dir=run_dir, name="after",
                       memory_file=ram) as resumed:
        after = resumed.console.counter()
        assert after >= before, f"counter went back from {before} to {after}: the guest restarted"
        assert resumed.console.token() == token
        wait_until(_counter_passes(resumed.console, after), 10, "the counter to keep counting after resume")
        resumed.console.request_poweroff()
        assert resumed.vm.wait(60) == 0

    # A truncated stream is refused by QEMU, and reported, rather than resuming a damaged guest.
    with pytest.raises(VMError):
        with resumed_guest(guest_artifacts, guest_disk, state[: len(state) // 2], run_dir=run_dir,
                           name="truncated", memory_file=ram):
            pass


def test_state_loads_without_the_boot_files_and_a_reset_then_ends_qemu(guest_artifacts: GuestArtifacts,
                                                                       guest_disk: Path, tmp_path: Path) -> None:
    """What lets `isr resume` skip the boot files: the state of a guest booted with -kernel/-initrd loads into a
    QEMU started without them and the guest runs on; there a reset cannot boot again, so with ``reset_exits``
    it ends QEMU and says why (the session then boots the guest with its boot files)."""
    ram = tmp_path / "ram.img"
    with booted_guest(guest_artifacts, guest_disk, run_dir=tmp_path, name="with-kernel", memory_file=ram) as guest:
        token = guest.console.set_token()
        state, _ = guest.vm.save_state_bytes()
        guest.vm.shutdown()
    with resumed_guest(guest_artifacts, guest_disk, state, run_dir=tmp_path, name="without", memory_file=ram,
                       kernel=None, initrd=None, cmdline=None, reset_exits=True) as resumed:
        assert "-kernel" not in resumed.vm.args and "reboot=shutdown" in resumed.vm.args
        assert resumed.console.token() == token
        before = resumed.console.counter()
        wait_until(_counter_passes(resumed.console, before), 10, "the counter to keep counting without a kernel")
        resumed.console.request_reboot()
        assert resumed.vm.wait(60) == 0
        assert resumed.vm.shutdown_reason == "guest-reset"
    # A guest that powers off says so too.
    with booted_guest(guest_artifacts, guest_disk, run_dir=tmp_path, name="off") as guest:
        guest.console.request_poweroff()
        assert guest.vm.wait(60) == 0
        assert guest.vm.shutdown_reason == "guest-shutdown"


def test_poweroff_request_is_sent_again_when_the_agent_garbles_it() -> None:
    """Under load the serial line has lost the start of a request line; the agent then names the rest as an
    unknown request, and nothing ran, so the console sends it again (for run() and for poweroff alike)."""
    host, guest = socket.socketpair()
    lines: list[str] = []

    def agent() -> None:
        with guest, guest.makefile("rwb", buffering=0) as f:
            for raw in f:
                line = raw.decode().strip()
                lines.append(line)
                if len(lines) == 1:
                    f.write(f"ISR-AGENT unknown request: {line.split()[-1][-4:]}\n".encode())
                else:
                    f.write(f"ISR-BEGIN {line.split()[1]}\n".encode())
                    return

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    with host, GuestConsole(host, name="fake") as console:
        console.request_poweroff()
    thread.join(timeout=10)
    assert len(lines) == 2 and all(line.startswith("ISR-RUN ") for line in lines)
    assert base64.b64decode(lines[1].split()[3]) == b"isr-poweroff"


def test_a_lost_request_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request line that vanished on the serial line (no reply at all) is sent again with the same id."""
    monkeypatch.setattr("tools.guest.console._RESEND_AFTER", 0.5)
    host, guest = socket.socketpair()
    lines: list[str] = []

    def agent() -> None:
        with guest, guest.makefile("rwb", buffering=0) as f:
            for raw in f:
                lines.append(raw.decode().strip())
                if len(lines) == 2:          # the first one is "lost"
                    request_id = lines[1].split()[1]
                    f.write(f"ISR-BEGIN {request_id}\nok\nISR-END {request_id} 0\n".encode())
                    return

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    with host, GuestConsole(host, name="fake") as console:
        assert console.run("echo ok", timeout=5) == (0, "ok")
    thread.join(timeout=10)
    assert len(lines) == 2 and lines[0] == lines[1]


def test_agent_runs_a_repeated_request_once(tmp_path: Path) -> None:
    """The guest's agent (run here by the host's sh) ignores a request with the id it ran last."""
    agent = Path(__file__).parent.parent / "tools" / "guest" / "files" / "isr-agent"

    def request(request_id: str, command: str) -> bytes:
        return f"ISR-RUN {request_id} 5 {base64.b64encode(command.encode()).decode()}\n".encode()

    marks = tmp_path / "runs"
    script = (request("a1", f"echo one >> {marks}") + request("a1", f"echo one >> {marks}") +
              request("a2", f"echo two >> {marks}"))
    proc = subprocess.Popen(["sh", str(agent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(script)
        proc.stdin.flush()
        out = b""
        while b"ISR-END a2" not in out:
            chunk = proc.stdout.read1(4096)
            assert chunk, out
            out += chunk
    finally:
        proc.kill()
        proc.wait()
    assert out.count(b"ISR-BEGIN a1") == 1 and out.count(b"ISR-BEGIN a2") == 1
    assert marks.read_text() == "one\ntwo\n"
