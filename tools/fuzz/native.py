"""The C harnesses (vulpes/fuzz/): built with clang's libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer,
seeded from the shared test vectors, run for a bounded time.

The harnesses are built here, not by meson: the meson build compiles with gcc and -Werror, and libFuzzer needs
clang. Every vulpes source but main.c is compiled again with coverage instrumentation into ``<out>/obj``; a
harness links those objects with its own ``LLVMFuzzerTestOneInput``. Rebuilding is by modification time, like
make: a second build with nothing changed compiles nothing.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from parcels import compress, resumepack
from parcels.testvectors import Vector, load

from .errors import FuzzError

SOURCE_DIR = Path(__file__).resolve().parents[2]
VULPES_SRC = SOURCE_DIR / "vulpes" / "src"
HARNESS_DIR = SOURCE_DIR / "vulpes" / "fuzz"
#: Inputs that once broke a harness (named after the target), replayed on every run.
REGRESS_DIR = HARNESS_DIR / "regress"
TARGETS = ("chunk", "seal", "keyring", "manifest", "envelope", "pack", "control")
#: The dictionary of JSON tokens and key names given to the JSON targets.
DICTIONARIES = {"manifest": "json.dict", "control": "json.dict"}
LIBRARIES = ("libcrypto", "libzstd", "sqlite3", "jansson", "fuse3", "libcurl")
SANITIZE = "address,undefined"
CFLAGS = ("-g", "-O1", "-std=gnu11", "-D_FILE_OFFSET_BITS=64", "-pthread", "-fno-omit-frame-pointer",
          "-fno-sanitize-recover=undefined", "-Wall", "-Wextra")
#: The parcel UUID the manifest harness asks for (FUZZ_PARCEL in fuzz_manifest.c).
FUZZ_PARCEL = "4e653b57-acae-4766-9bfe-71f70decf1a5"


def find_clang() -> str | None:
    """A clang whose libFuzzer runtime is installed (Debian: clang-14 and libclang-rt-14-dev), or None."""
    for name in ("clang-14", "clang"):
        clang = shutil.which(name)
        if clang is None:
            continue
        result = subprocess.run([clang, "-print-runtime-dir"], capture_output=True, text=True, timeout=30)
        runtime = Path(result.stdout.strip())
        if result.returncode == 0 and any(runtime.glob("libclang_rt.fuzzer*.a")):
            return clang
    return None


def _pkg_config(*args: str) -> list[str]:
    result = subprocess.run(["pkg-config", *args, *LIBRARIES], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise FuzzError(f"pkg-config {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.split()


def _newer(target: Path, sources: Iterable[Path]) -> bool:
    """True if target is missing or older than any of sources."""
    try:
        built = target.stat().st_mtime
    except FileNotFoundError:
        return True
    return any(source.stat().st_mtime > built for source in sources)


def _compile(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise FuzzError(f"compiling failed: {' '.join(command)}\n{result.stderr}")


def build(out: Path, targets: Iterable[str] = TARGETS, jobs: int = 2) -> dict[str, Path]:
    """Build the harnesses of `targets` into `out`; returns each target's executable. Raises FuzzError without
    clang's libFuzzer or when a compile fails."""
    clang = find_clang()
    if clang is None:
        raise FuzzError("no clang with libFuzzer: install clang-14 and libclang-rt-14-dev (deps/debian.txt)")
    cflags = [*CFLAGS, f"-I{VULPES_SRC}", f"-I{HARNESS_DIR}", *_pkg_config("--cflags")]
    headers = sorted(VULPES_SRC.glob("*.h")) + sorted(HARNESS_DIR.glob("*.h"))
    obj = out / "obj"
    obj.mkdir(parents=True, exist_ok=True)
    commands: list[list[str]] = []
    objects: list[Path] = []
    for source in sorted(VULPES_SRC.glob("*.c")):
        if source.name == "main.c":
            continue
        target = obj / (source.stem + ".o")
        objects.append(target)
        if _newer(target, [source, *headers]):
            commands.append([clang, *cflags, f"-fsanitize=fuzzer-no-link,{SANITIZE}", "-c", str(source),
                             "-o", str(target)])
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(_compile, commands))
    libs = _pkg_config("--libs")
    built: dict[str, Path] = {}
    links: list[list[str]] = []
    for name in targets:
        if name not in TARGETS:
            raise FuzzError(f"no C fuzz target {name!r}: the targets are {', '.join(TARGETS)}")
        source = HARNESS_DIR / f"fuzz_{name}.c"
        exe = out / f"fuzz_{name}"
        built[name] = exe
        if _newer(exe, [source, *headers, *objects]):
            links.append([clang, *cflags, f"-fsanitize=fuzzer,{SANITIZE}", str(source), *map(str, objects),
                          *libs, "-o", str(exe)])
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(_compile, links))
    return built


# --- seeds ---------------------------------------------------------------------------------------------------


def _u(value: int, size: int) -> bytes:
    return value.to_bytes(size, "big")


def _field(vector: Vector, key: str) -> bytes | None:
    text = vector.fields.get(key)
    if text is None:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def _chunk_seeds() -> Iterable[bytes]:
    for vector in load("chunks.txt"):
        length = int(vector.fields.get("length", "0") or 0) % (4194304 + 1)
        obj = _field(vector, "object")
        if obj is not None:
            yield b"\0" + _u(length, 3) + obj
        plaintext = _field(vector, "plaintext")
        if plaintext and vector.ok and len(plaintext) <= 65536:
            frame = compress.compress(plaintext)
            yield b"\1" + _u(len(plaintext), 3) + b"\1" + _u(len(plaintext), 4) + frame
            yield b"\1" + _u(len(plaintext), 3) + b"\0" + _u(len(plaintext), 4) + plaintext
            yield b"\2" + _u(0, 3) + plaintext[:4096]


def _seal_seeds() -> Iterable[bytes]:
    for vector in load("blobs.txt"):
        kind = int(vector.fields.get("kind", "1") or 1) & 0xFF
        blob = _field(vector, "blob")
        if blob is not None:
            yield bytes([0, kind]) + blob
        payload = _field(vector, "payload")
        if payload is not None and vector.ok and len(payload) <= 65536:
            yield bytes([1, kind, 1]) + _u(len(payload), 4) + compress.compress(payload)
            yield bytes([1, kind, 0]) + _u(len(payload), 4) + payload
            yield bytes([2, kind]) + payload[:4096]


def _keyring_seeds() -> Iterable[bytes]:
    for vector in load("keyrings.txt"):
        stream = _field(vector, "stream")
        if stream is not None:
            yield stream


def _manifest_seeds() -> Iterable[bytes]:
    for vector in load("manifests.txt"):
        text = _field(vector, "json")
        if text is None:
            continue
        own = vector.fields.get("uuid", "")
        if own:
            text = text.replace(str(uuid.UUID(own)).encode(), FUZZ_PARCEL.encode())
        version = int(vector.fields.get("version", "1") or 1) & 0xFF
        yield bytes([0, version]) + text
        yield bytes([1, version]) + text


def _envelope_seeds() -> Iterable[bytes]:
    for vector in load("keyenvelopes.txt"):
        envelope = _field(vector, "envelope")
        if envelope is not None:
            yield b"\0" + envelope
            yield b"\1" + envelope
        keyfile = _field(vector, "keyfile")
        if keyfile:
            yield b"\2" + keyfile


def _pack_seeds() -> Iterable[bytes]:
    image = 16 << 20
    for extents in ([], [(0, b"a")], [(4096, b"x" * 4096), (65536, b"y" * 100)], [(image - 3, b"end")]):
        yield _u(image, 8) + resumepack.encode(image, extents)
    yield _u(4096, 8) + resumepack.encode(4096, [(0, bytes(4096))])


def _control_seeds() -> Iterable[bytes]:
    requests = [
        '{"op":"status"}', '{"op":"flush"}', '{"op":"reclaim"}', '{"op":"cache-limit","limit":1048576}',
        '{"op":"cache-limit","limit":0}', '{"op":"hoard","disk":"all","memory":[0,1,2]}',
        '{"op":"hoard","memory":{"first":[5,3],"then":"all"},"priority":"idle","wait":true}',
        '{"op":"hoard-stop"}', '{"op":"preload","image":"memory","path":"/x"}', '{"op":"offline"}',
        '{"op":"online"}', '{"op":"writeback","enabled":true,"rate":1000}', '{"op":"upload"}',
        '{"op":"trace-start","path":"/x"}', '{"op":"trace-stop"}', '{"op":"checkin-done"}', '{"op":"nope"}',
        '[]', '{', '',
    ]
    for request in requests:
        yield request.encode() + b"\n"


SEEDS = {"chunk": _chunk_seeds, "seal": _seal_seeds, "keyring": _keyring_seeds, "manifest": _manifest_seeds,
         "envelope": _envelope_seeds, "pack": _pack_seeds, "control": _control_seeds}


def write_seeds(target: str, directory: Path) -> int:
    """Write the seed corpus of `target` (from the test vectors) into `directory`; returns how many."""
    directory.mkdir(parents=True, exist_ok=True)
    count = 0
    for count, seed in enumerate(SEEDS[target](), start=1):
        (directory / f"seed-{count:04d}").write_bytes(seed)
    return count


# --- running ---------------------------------------------------------------------------------------------------


@dataclass
class NativeRun:
    """What one bounded libFuzzer run did."""

    target: str
    seconds: float
    executions: int
    corpus_files: int
    corpus_bytes: int
    coverage: int
    findings: list[Path] = field(default_factory=list)
    output: str = ""

    @property
    def ok(self) -> bool:
        return not self.findings


def run(exe: Path, target: str, work: Path, seconds: int, *, seed: int | None = None) -> NativeRun:
    """Fuzz `target` for `seconds` with its corpus in ``work/corpus`` (grown in place, seeded from the test
    vectors and the regression inputs) and what it finds in ``work/findings``."""
    corpus, seeds, findings = work / "corpus", work / "seeds", work / "findings"
    for directory in (corpus, findings):
        directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(seeds, ignore_errors=True)
    write_seeds(target, seeds)
    regress = REGRESS_DIR / target
    args = [str(exe), f"-max_total_time={seconds}", "-print_final_stats=1", "-timeout=10", "-rss_limit_mb=2048",
            "-max_len=65536", f"-artifact_prefix={findings}/", str(corpus), str(seeds)]
    if regress.is_dir():
        args.append(str(regress))
    if seed is not None:
        args.insert(1, f"-seed={seed}")
    if target in DICTIONARIES:
        args.insert(1, f"-dict={HARNESS_DIR / DICTIONARIES[target]}")
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"}
    before = set(findings.iterdir())
    started = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 300, env=env)
    elapsed = time.monotonic() - started
    output = result.stderr
    executions = _stat(output, "number_of_executed_units")
    coverage = max((int(m) for m in re.findall(r"\bcov: (\d+)", output)), default=0)
    files = [p for p in corpus.iterdir() if p.is_file()]
    found = sorted(set(findings.iterdir()) - before)
    if result.returncode != 0 and not found:
        raise FuzzError(f"fuzz_{target} exited with {result.returncode} and saved no input:\n{output[-4000:]}")
    return NativeRun(target, elapsed, executions, len(files), sum(p.stat().st_size for p in files), coverage,
                     found, output)


def _stat(output: str, name: str) -> int:
    match = re.search(rf"stat::{name}:\s*(\d+)", output)
    return int(match.group(1)) if match else 0


def replay(exe: Path, inputs: Iterable[Path]) -> subprocess.CompletedProcess[str]:
    """Run a harness once over each of `inputs` (no fuzzing): how a finding is reproduced."""
    return subprocess.run([str(exe), *map(str, inputs)], capture_output=True, text=True, timeout=600)

