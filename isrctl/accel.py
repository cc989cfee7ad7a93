"""Which accelerator works here: a probe that boots a guest under KVM once and remembers the answer."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import platform
import shutil
import time
from pathlib import Path

from . import paths
from .errors import VMError
from .qemu import VM, VMConfig

log = logging.getLogger(__name__)

#: How long the probe blocks on the serial console before it looks at the clock again.
_SERIAL_WAIT = 0.2

_kvm_answers: dict[str, bool] = {}


def kvm_works(kernel: Path, initrd: Path | None, *, marker: bytes, cmdline: str = "console=ttyS0",
              disk: Path | None = None, timeout: float = 30.0, cache_dir: Path | None = None) -> bool:
    """Whether a guest really boots under KVM here, found by booting it and caching the answer.

    ``/dev/kvm`` existing is not enough: some hosts offer a paravirtual KVM on which stock guest kernels
    crawl and then die with emulation failures. So the probe boots ``kernel`` (and ``initrd``, with an
    optional read-only ``disk``) with ``-accel kvm`` and says yes only if ``marker`` appears on the serial
    console within ``timeout`` seconds. The answer is remembered per host kernel, QEMU binary and guest
    kernel, in memory and in ``cache_dir`` (default `paths.cache_dir`).
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    qemu = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
    key_parts = [platform.release(), qemu, str(_mtime_size(Path(qemu))), str(_mtime_size(kernel)),
                 str(kernel), str(initrd), cmdline, marker.decode(errors="replace")]
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:32]
    if key in _kvm_answers:
        return _kvm_answers[key]
    cache_file = (cache_dir or paths.cache_dir()) / "kvm-probe.json"
    try:
        answers = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        answers = {}
    remembered = answers.get(key)
    if isinstance(remembered, bool):
        _kvm_answers[key] = remembered
        return remembered
    answer = _probe_kvm(kernel, initrd, marker=marker, cmdline=cmdline, disk=disk, timeout=timeout)
    log.info("KVM probe: guest %s under KVM", "boots" if answer else "does not boot")
    _kvm_answers[key] = answer
    answers[key] = answer
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(answers, indent=1) + "\n")
        os.replace(tmp, cache_file)
    except OSError as exc:
        log.warning("cannot remember the KVM probe result in %s: %s", cache_file, exc)
    return answer


def _mtime_size(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


def _probe_kvm(kernel: Path, initrd: Path | None, *, marker: bytes, cmdline: str, disk: Path | None,
               timeout: float) -> bool:
    config = VMConfig(disk=disk, disk_readonly=disk is not None, kernel=kernel, initrd=initrd,
                      cmdline=cmdline, accel="kvm")
    seen = b""
    with VM(config, name="kvm-probe") as vm:
        try:
            vm.launch(timeout=min(timeout, 30.0))
        except VMError as exc:
            log.info("KVM probe: QEMU did not start with KVM: %s", exc)
            return False
        deadline = time.monotonic() + timeout
        vm.serial.settimeout(_SERIAL_WAIT)
        while time.monotonic() < deadline and vm.is_running():
            try:
                data = vm.serial.recv(65536)
            except TimeoutError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                break
            if not data:
                break
            seen = (seen + data)[-(len(marker) + 65536):]
            if marker in seen:
                return True
        vm.kill()
    return False
