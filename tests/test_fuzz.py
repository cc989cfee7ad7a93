"""The bounded fuzzing pass of CI (doc/fuzzing.md): every C harness under libFuzzer for a few seconds, and every
Python property with a fixed example budget. The longer pass is ``python -m tools.fuzz all --seconds N``.

The C harnesses run two at a time (the machine has two cores), seeded from the test vectors and the inputs in
vulpes/fuzz/regress/ that once broke them. The Python properties run derandomized, so that CI sees the same
examples every time; the inputs that once failed are pinned below with @example.
"""
from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tools.fuzz import native
from tools.fuzz.properties import PROPERTIES, refused_only

#: Seconds each C harness fuzzes in CI.
C_SECONDS = 4
#: Examples each Python property gets in CI.
PYTHON_EXAMPLES = 300

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def native_runs(build_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, native.NativeRun]:
    if native.find_clang() is None:
        pytest.fail("no clang with libFuzzer: ./bootstrap installs clang-14 and libclang-rt-14-dev (deps/debian.txt)")
    started = time.monotonic()
    exes = native.build(build_dir / "fuzz" / "bin")
    work = tmp_path_factory.mktemp("fuzz")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {target: pool.submit(native.run, exes[target], target, work / target, C_SECONDS, seed=1)
                   for target in native.TARGETS}
        runs = {target: future.result() for target, future in futures.items()}
    print(f"C harnesses built and fuzzed in {time.monotonic() - started:.1f} s")
    return runs


@pytest.mark.parametrize("target", native.TARGETS)
def test_c_harness_finds_nothing(native_runs: dict[str, native.NativeRun], target: str) -> None:
    run = native_runs[target]
    assert run.executions > 0, run.output[-2000:]
    assert run.ok, f"fuzz_{target} found {', '.join(map(str, run.findings))}:\n{run.output[-6000:]}"


def test_regression_inputs_replay(build_dir: Path) -> None:
    """Every input that once broke a harness is replayed and passes now (also part of each run's corpus)."""
    if native.find_clang() is None:
        pytest.fail("no clang with libFuzzer: ./bootstrap installs clang-14 and libclang-rt-14-dev")
    exes = native.build(build_dir / "fuzz" / "bin")
    for directory in sorted(native.REGRESS_DIR.iterdir()) if native.REGRESS_DIR.is_dir() else []:
        inputs = sorted(directory.iterdir())
        result = native.replay(exes[directory.name], inputs)
        assert result.returncode == 0, f"{directory.name}: {result.stderr[-4000:]}"


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_python_property(name: str) -> None:
    settings(max_examples=PYTHON_EXAMPLES, derandomize=True, database=None, deadline=None,
             suppress_health_check=list(HealthCheck))(PROPERTIES[name])()


def test_a_foreign_exception_is_a_finding() -> None:
    """refused_only lets through exactly what it is told to: anything else fails the property."""
    assert refused_only(ValueError, int, "x") is None
    with pytest.raises(ZeroDivisionError):
        refused_only(ValueError, lambda: 1 // 0)
