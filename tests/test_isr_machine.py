"""Seeing and using a running parcel through the real `isr` command: `isr console` (two clients at once,
after --detach, a terminal in raw mode and restored), `isr viewer` (the connection line, a viewer started,
a password on a TCP display), user-mode networking with port forwards and virtio-rng, and `isr poweroff`
(the ACPI power button, then the plug after a timeout)."""
from __future__ import annotations

import base64
import os
import pty
import secrets
import select
import socket
import subprocess
import termios
import time
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.decrepit.ciphers.algorithms import TripleDES
from cryptography.hazmat.primitives.ciphers import Cipher, modes

from parcels import devices
from parcels import parcel as parcel_ops
from parcels.errors import FormatError
from parcels.store import DirStore
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, Site, isr_env, one_line_error, sites  # noqa: F401  (isr_env: pytest fixture)

pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_until(fd: int, marker: bytes, timeout: float, seen: bytearray) -> bytes:
    """Read ``fd`` into ``seen`` until ``marker`` is in it; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"{marker!r} did not come within {timeout} s; got {bytes(seen[-2000:])!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                pytest.fail(f"end of output before {marker!r}; got {bytes(seen[-2000:])!r}")
            seen += data
    return bytes(seen)


def agent_request(request_id: str, command: str) -> bytes:
    """A request line of the test guest's agent (tools/guest/README.md)."""
    return f"ISR-RUN {request_id} 30 {base64.b64encode(command.encode()).decode()}\n".encode()


def run_through_console(proc: subprocess.Popen[bytes], command: str) -> bytes:
    """Run ``command`` in the guest through an `isr console` process's stdin and stdout; returns its output."""
    assert proc.stdin is not None and proc.stdout is not None
    request_id = f"c{secrets.token_hex(4)}"
    seen = bytearray()
    # The serial line can lose a request under load: send it again (same id, so it runs once) until it starts.
    for _ in range(10):
        proc.stdin.write(agent_request(request_id, command))
        proc.stdin.flush()
        deadline = time.monotonic() + 10
        while f"ISR-BEGIN {request_id}".encode() not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1)
            if ready:
                seen += os.read(proc.stdout.fileno(), 65536)
        if f"ISR-BEGIN {request_id}".encode() in seen:
            break
    read_until(proc.stdout.fileno(), f"ISR-END {request_id} 0".encode(), 60, seen)
    return bytes(seen)


def http_get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := conn.recv(4096):
            data += chunk
    return data


def rfb_security_types(sock: socket.socket) -> list[int]:
    """Start an RFB 3.8 handshake; the security types the server offers (1 none, 2 VNC password)."""
    version = sock.recv(12)
    assert version.startswith(b"RFB 003."), version
    sock.sendall(b"RFB 003.008\n")
    count = sock.recv(1)[0]
    return list(sock.recv(count))


def vnc_password_result(sock: socket.socket, password: str) -> int:
    """After `rfb_security_types` offered VNC authentication: answer its DES challenge with ``password``; the
    server's SecurityResult (0: accepted)."""
    sock.sendall(b"\x02")
    challenge = b""
    while len(challenge) < 16:
        challenge += sock.recv(16 - len(challenge))
    # The key is the password padded to 8 bytes, each byte's bits reversed (RFC 6143 7.2.2); single DES.
    key = bytes(int(f"{b:08b}"[::-1], 2) for b in password.encode()[:8].ljust(8, b"\0"))
    encryptor = Cipher(TripleDES(key * 3), modes.ECB()).encryptor()
    sock.sendall(encryptor.update(challenge) + encryptor.finalize())
    return int.from_bytes(sock.recv(4), "big")


def test_forward_specs_are_checked_and_written_canonically() -> None:
    assert str(devices.parse_forward("tcp:2222-:22")) == "tcp:127.0.0.1:2222-:22"
    assert str(devices.parse_forward("udp:0.0.0.0:5353-10.0.2.15:53")) == "udp:0.0.0.0:5353-10.0.2.15:53"
    assert str(devices.parse_forward("8080-80")) == "tcp:127.0.0.1:8080-:80"
    for bad in ("ssh", "tcp:2222", "tcp:70000-:22", "tcp:0-:22", "sctp:1-:2", "tcp:host:1-:2", "tcp:1.2.3:1-:2"):
        with pytest.raises(FormatError, match="bad port forward"):
            devices.parse_forward(bad)
    with pytest.raises(FormatError, match="same host port"):
        devices.parse_forwards(["tcp:2222-:22", "2222-:23"])
    assert devices.problems({"net": "none", "forward": "tcp:2222-:22"}) == [
        "port forwards need the user-mode network (device net=user)"]
    assert devices.problems(devices.DEFAULT) == []


def test_console_viewer_forwards_and_rng(isr_env: IsrEnv, tmp_path: Path) -> None:
    web, busy_port = free_port(), free_port()
    parcel = isr_env.make_parcel(vm={"devices": {"forward": f"tcp:{web}-:80 tcp:{busy_port}-:81"}})
    with sites(isr_env, tmp_path, ["A"]) as (a,), socket.socket() as busy:
        busy.bind(("127.0.0.1", busy_port))
        busy.listen()
        # A host port in use: that forward is left out with one line, the VM runs with the others.
        out = a.resume(parcel).stdout
        assert f"port forward tcp:127.0.0.1:{busy_port}-:81 left out" in out, out
        assert f"127.0.0.1:{web} -> guest tcp port 80" in out, out
        assert a.session(parcel)["forwards"] == [f"tcp:127.0.0.1:{web}-:80"]
        stat = a.isr("stat", parcel.name).stdout
        assert f"forwards tcp:127.0.0.1:{web}-:80" in stat and "(this PC only)" in stat, stat
        with a.console(parcel) as guest:
            guest.wait_ready(90)
            assert guest.check("cat /sys/class/misc/hw_random/rng_current").strip() == "virtio_rng.0"
            guest.check("mkdir -p /run/www && echo hello-from-the-guest >/run/www/index.html && "
                        "httpd -p 80 -h /run/www")
            assert http_get(web).endswith(b"\r\n\r\nhello-from-the-guest\n")

            # `isr console` (no terminal: a script) while the first client stays attached; after --detach.
            with subprocess.Popen(a.command("console", parcel.name), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=a.environ()) as proc:
                seen = run_through_console(proc, "echo second-client-$((6 * 7))")
                assert b"ISR-GUEST-READY" in seen, "the console does not show what the guest printed before"
                assert b"second-client-42" in seen
                assert guest.check("echo first-client-too").strip() == "first-client-too"
                assert proc.stdin is not None
                proc.stdin.close()
                assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""

            # On a terminal: raw mode, the detach key announced and working, the terminal as it was after.
            controller, terminal = pty.openpty()
            before = termios.tcgetattr(terminal)
            try:
                with subprocess.Popen(a.command("console", parcel.name), stdin=terminal, stdout=terminal,
                                      stderr=terminal, env=a.environ(), start_new_session=True) as proc:
                    seen = bytearray()
                    read_until(controller, b"Ctrl-] detaches", 60, seen)
                    read_until(controller, b"ISR-GUEST-READY", 60, seen)
                    attrs = termios.tcgetattr(terminal)
                    assert not attrs[3] & (termios.ICANON | termios.ECHO), "the terminal is not in raw mode"
                    os.write(controller, b"\x1d")
                    assert proc.wait(60) == 0
                    read_until(controller, b"detached", 10, seen)
                assert termios.tcgetattr(terminal) == before, "the terminal was not restored"
            finally:
                os.close(controller)
                os.close(terminal)

        # `isr viewer`: without a viewer (or a graphical session) it says how to connect; with one it starts it.
        env = {**a.environ(), "PATH": str(tmp_path / "none")}
        env.pop("DISPLAY", None)
        env.pop("WAYLAND_DISPLAY", None)
        shown = subprocess.run(a.command("viewer", parcel.name), capture_output=True, text=True, env=env,
                               timeout=60)
        assert shown.returncode == 0, shown.stderr
        vnc = Path(a.session(parcel)["vnc_display"]["path"])
        assert f"VNC display on the Unix socket {vnc}" in shown.stdout and "no VNC viewer" in shown.stdout
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(vnc))
            assert rfb_security_types(s) == [1], "a display only this PC reaches needs no password"
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "vncviewer").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'viewer-args'}\n")
        (fake / "vncviewer").chmod(0o755)
        started = subprocess.run(a.command("viewer", parcel.name), capture_output=True, text=True, timeout=60,
                                 env={**env, "PATH": str(fake), "DISPLAY": ":99"})
        assert started.returncode == 0, started.stderr
        assert (tmp_path / "viewer-args").read_text().split() == [str(vnc)]

        a.isr("poweroff", parcel.name, "--force", "--no-checkin")
        a.wait_session_end(parcel)
        result = a.isr("console", parcel.name, check=False)
        one_line_error(result, "not running at this site", f"isr resume {parcel.name}")


def test_poweroff_shuts_down_cleanly_then_forces_after_the_timeout(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        number = next(n for n in range(40, 100) if _tcp_free(5900 + n))
        out = a.resume(parcel, "--vnc", f"0.0.0.0:{number}").stdout
        assert "password: `isr viewer`" in out, out
        shown = a.isr("viewer", parcel.name, "--print").stdout
        assert f"0.0.0.0:{5900 + number}" in shown and "password: " in shown
        password = shown.split("password: ")[1].split()[0]
        for attempt, accepted in ((password[::-1] + "x", False), (password, True)):
            with socket.create_connection(("127.0.0.1", 5900 + number), timeout=30) as s:
                assert rfb_security_types(s) == [2], "a display on the network must ask for a password"
                assert (vnc_password_result(s, attempt) == 0) == accepted, attempt
        with a.console(parcel) as guest:
            guest.wait_ready(90)
            guest.check("echo kept >/data/before-poweroff")

        # The ACPI power button: the guest unmounts its disk and powers off; the version checked in is clean.
        out = a.isr("poweroff", parcel.name).stdout
        assert "ACPI power button" in out and "shut down cleanly" in out, out
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 2
        isr_env.check_committed_disk(parcel, tmp_path)

        # It boots cold from that version with the disk intact; a guest that ignores the button is cut off.
        out = a.resume(parcel).stdout
        assert "booted cold" in out, out
        with a.console(parcel) as guest:
            guest.wait_ready(90)
            assert guest.check("cat /data/before-poweroff").strip() == "kept"
            guest.check("killall acpid")
        out = a.isr("poweroff", parcel.name, "--timeout", "2").stdout
        assert "did not power off within 2 s: pulling the plug" in out, out
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 3


def _tcp_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def test_bad_poweroff_timeout_is_one_line(isr_env: IsrEnv, tmp_path: Path) -> None:
    site = Site("A", tmp_path / "A", isr_env)
    result = site.isr("poweroff", "nothing-here", "--timeout", "soon", check=False)
    assert result.returncode == 2 and "--timeout" in result.stderr


def test_admin_sets_forwards_and_refuses_bad_ones_in_one_line(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    store = DirStore(isr_env.store)
    keys = parcel_ops.unlock(store, uuid.UUID(parcel.id), keyfile=parcel.keyfile.read_bytes())

    def vm_devices() -> dict[str, str]:
        version = parcel_ops.latest_version(store, uuid.UUID(parcel.id))
        return dict(parcel_ops.open_version(store, uuid.UUID(parcel.id), version, keys).manifest.vm.devices)

    assert vm_devices() == devices.DEFAULT, "a new parcel has user-mode networking and virtio-rng"
    ref = f"alice/{parcel.name}"
    for args, words in ((["--forward", "tcp:22"], ["bad port forward 'tcp:22'", "tcp:2222-:22"]),
                        (["--forward", "tcp:2222-:22", "--forward", "2222-:23"], ["same host port"]),
                        (["--forward", "tcp:2222-:22", "--net", "none"], ["need the user-mode network"]),
                        ([], ["nothing to set"])):
        bad = isr_env.server.admin("parcel", "set", ref, *args, "--key-file", str(parcel.keyfile), check=False)
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr
        for word in words:
            assert word in bad.stderr, (word, bad.stderr)
    assert isr_env.current_version(parcel) == 1, "a refused change made a version"

    isr_env.server.admin("parcel", "set", ref, "--forward", "tcp:2222-:22", "--forward", "udp:0.0.0.0:5353-:53",
                         "--key-file", str(parcel.keyfile))
    assert isr_env.current_version(parcel) == 2
    assert vm_devices()["forward"] == "tcp:127.0.0.1:2222-:22 udp:0.0.0.0:5353-:53"
    isr_env.server.admin("parcel", "set", ref, "--no-forwards", "--net", "none", "--key-file", str(parcel.keyfile))
    assert "forward" not in vm_devices() and vm_devices()["net"] == "none"
