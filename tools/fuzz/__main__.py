"""``python -m tools.fuzz``: the long fuzzing pass by hand (doc/fuzzing.md); tests/test_fuzz.py runs a short one.

    python -m tools.fuzz build [--out DIR]                               build the C harnesses (clang, libFuzzer)
    python -m tools.fuzz c [--seconds N] [--out DIR] [TARGET...]         libFuzzer on the C harnesses
    python -m tools.fuzz python [--seconds N] [--out DIR] [PROPERTY...]  atheris on the Python properties
    python -m tools.fuzz all [--seconds N] [--out DIR]                   both, one target after the other

Each target runs alone for --seconds (default 120) with its corpus kept in DIR/<kind>/<target>/corpus (default
DIR: build/fuzz), so a second pass goes on from where the first stopped. What a target finds (a crash, a hang,
a sanitizer report, an exception outside the package's error root) is saved in DIR/<kind>/<target>/findings and
reported; the exit code is 1 if anything was found. One line per target is printed and appended, with the date,
to DIR/report.jsonl.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import FuzzError

if TYPE_CHECKING:
    from . import native

PROG = "python -m tools.fuzz"


# tools.fuzz.native (and with it parcels) is imported only where needed: the atheris worker must import the
# packages under test itself, inside its instrumentation.
SOURCE_DIR = Path(__file__).resolve().parents[2]


def _default_out() -> Path:
    return Path(os.environ.get("ISR_BUILD_DIR", SOURCE_DIR / "build")) / "fuzz"


def _report(out: Path, kind: str, run: "native.NativeRun") -> None:
    line = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "kind": kind,
            "target": run.target, "seconds": round(run.seconds, 1), "executions": run.executions,
            "corpus_files": run.corpus_files, "corpus_bytes": run.corpus_bytes, "coverage": run.coverage,
            "findings": [str(p) for p in run.findings]}
    with open(out / "report.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    found = f"{len(run.findings)} FOUND: {', '.join(p.name for p in run.findings)}" if run.findings else "nothing found"
    print(f"{kind:6} {run.target:16} {run.seconds:6.0f} s {run.executions:>11,} runs  corpus {run.corpus_files:>5} "
          f"files {run.corpus_bytes:>9,} B  cov {run.coverage:>5}  {found}", flush=True)


def run_c(out: Path, targets: Sequence[str], seconds: int) -> bool:
    from . import native

    exes = native.build(out / "bin", targets)
    clean = True
    for target in targets:
        run = native.run(exes[target], target, out / "c" / target, seconds)
        _report(out, "c", run)
        clean = clean and run.ok
    return clean


def run_python(out: Path, names: Sequence[str], seconds: int) -> bool:
    from . import native
    from .properties import PROPERTIES

    clean = True
    for name in names:
        if name not in PROPERTIES:
            raise FuzzError(f"no Python fuzz property {name!r}: the properties are {', '.join(PROPERTIES)}")
        work = out / "python" / name
        corpus, findings = work / "corpus", work / "findings"
        corpus.mkdir(parents=True, exist_ok=True)
        findings.mkdir(parents=True, exist_ok=True)
        before = set(findings.iterdir())
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "tools.fuzz", "_atheris", name, f"-max_total_time={seconds}",
                                 "-print_final_stats=1", "-timeout=30", "-rss_limit_mb=4096",
                                 f"-artifact_prefix={findings}/", str(corpus)],
                                capture_output=True, text=True, timeout=seconds + 600, cwd=SOURCE_DIR)
        output = result.stderr + result.stdout
        found = sorted(set(findings.iterdir()) - before)
        if result.returncode != 0 and not found:
            raise FuzzError(f"atheris on {name} exited with {result.returncode} and saved no input:\n{output[-4000:]}")
        if found:
            (work / f"output-{int(time.time())}.txt").write_text(output)
        files = [p for p in corpus.iterdir() if p.is_file()]
        run = native.NativeRun(name, time.monotonic() - started, native._stat(output, "number_of_executed_units"),
                               len(files), sum(p.stat().st_size for p in files),
                               max((int(m) for m in re.findall(r"\bcov: (\d+)", output)), default=0), found, output)
        _report(out, "python", run)
        clean = clean and run.ok
    return clean


def _atheris_worker(name: str, libfuzzer_args: list[str]) -> None:
    """Runs in its own process (atheris.Fuzz() does not return): one property under atheris."""
    import logging

    import atheris
    from hypothesis import HealthCheck, settings

    # The packages under test (and the parsers they hand bytes to) are instrumented as they are imported, so
    # that atheris sees their coverage; instrumenting everything loaded would take longer than a short run.
    with atheris.instrument_imports(include=["parcels", "isrctl", "server", "icalendar", "recurring_ical_events",
                                             "starlette", "json", "uuid", "zoneinfo"]):
        from . import properties
        import isrctl.calendar  # noqa: F401
        import server.app  # noqa: F401

    logging.getLogger("server").setLevel(logging.CRITICAL)
    prop = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))(properties.PROPERTIES[name])
    atheris.Setup([sys.argv[0], *libfuzzer_args], prop.hypothesis.fuzz_one_input)  # type: ignore[attr-defined]
    atheris.Fuzz()


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["_atheris"]:
        _atheris_worker(args_list[1], args_list[2:])
        return 0
    parser = argparse.ArgumentParser(prog=PROG, description="Fuzz the parsers of outside bytes (doc/fuzzing.md).")
    parser.add_argument("command", choices=["build", "c", "python", "all"])
    parser.add_argument("targets", nargs="*", help="C targets or Python properties (default: all of them)")
    parser.add_argument("--seconds", type=int, default=120, help="time per target (default 120)")
    parser.add_argument("--out", type=Path, default=None, help="build, corpus and findings (default build/fuzz)")
    args = parser.parse_intermixed_args(args_list)
    out = (args.out or _default_out()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from . import native

    try:
        if args.command == "build":
            for target, exe in native.build(out / "bin", args.targets or native.TARGETS).items():
                print(f"{target}: {exe}")
            return 0
        from .properties import PROPERTIES

        clean = True
        if args.command in ("c", "all"):
            c_targets = args.targets if args.command == "c" else []
            clean = run_c(out, c_targets or native.TARGETS, args.seconds) and clean
        if args.command in ("python", "all"):
            names = args.targets if args.command == "python" else []
            clean = run_python(out, names or list(PROPERTIES), args.seconds) and clean
    except FuzzError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
