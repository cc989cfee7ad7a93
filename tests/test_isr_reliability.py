"""The `isr` command where things go wrong without a VM (issue 16): damaged files, a lock that changed
hands behind this site's back, a release that failed, a server that does not answer. Each test runs `isr`
as a person would, against a real isr-server, and checks for one line that says what happened and what to
do, and that nothing was lost."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, isr_env, sites  # noqa: F401  (isr_env: pytest fixture)

pytestmark = pytest.mark.timeout(300)


def one_line_error(result, *words: str) -> str:  # type: ignore[no-untyped-def]
    """Assert that `isr` failed with exit code 1 and one line on stderr containing every word."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    return str(result.stderr)


def test_non_utf8_config_and_token_name_the_file(isr_env: IsrEnv, tmp_path: Path) -> None:
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        config = a.root / "config" / "isr" / "config.toml"
        token = a.root / "data" / "isr" / "token"
        good_config, good_token = config.read_bytes(), token.read_bytes()
        config.write_bytes(good_config + b'# caf\xe9 \xff\n')
        one_line_error(a.isr("ls", check=False), str(config), "UTF-8")
        config.write_bytes(good_config)
        token.write_bytes(b"isr_\xff\xfe" + good_token[4:])
        one_line_error(a.isr("ls", check=False), str(token), "UTF-8")
        token.write_bytes(good_token)
        a.isr("ls")
