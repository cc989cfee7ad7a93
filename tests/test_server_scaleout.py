"""Scale-out: two isr-server processes share one PostgreSQL database and one S3 bucket. They keep no state
of their own, so a client may use either, and the database alone decides who gets a lock: a parcel checked
in through one is resumed through the other by the real `isr`, gc run beside one loses nothing the other
commits, and a token revoked on one is refused by the other within server.token_cache_seconds."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from isrctl.remote import AuthenticationFailed, LockHeld
from server import ops
from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401
from tests.isr_fixtures import IsrEnv, check_continues, sites, work_and_check_in
from tests.server_fixtures import (PASSWORDS, ServerEnv, ServerProcess, postgres_dsn, s3_server,  # noqa: F401
                                   start_env)
from tests.test_server_api import make_chunk, make_version
from tools.guest import GuestArtifacts

pytestmark = pytest.mark.timeout(180)
ROUNDS = 12
TOKEN_CACHE_SECONDS = 5
GC_GRACE = 5.0


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
                ) -> Iterator[tuple[ServerEnv, ServerProcess]]:
    root: Path = tmp_path_factory.mktemp("scaleout")
    # Settings the real isr needs (a memory image is one blob; a session holds its lock for minutes).
    first = start_env("postgres-s3", root / "a", request, **{
        "server.max_blob_bytes": 256 << 20, "server.lock_lease_seconds": 30,
        "server.token_cache_seconds": TOKEN_CACHE_SECONDS})
    second = ServerProcess(first.config, root / "b.log")
    try:
        second.start()
        yield first, second
    finally:
        second.stop()
        first.server.stop()
        for server in (first.server, second):
            assert "Traceback" not in server.output(), server.output()


def test_servers_share_all_state(two_servers: tuple[ServerEnv, ServerProcess]) -> None:
    env, other = two_servers
    assert env.server.url != other.url
    parcel = env.new_parcel("alice")
    with env.client("alice") as a, other.client() as b:
        b.login("alice", PASSWORDS["alice"])
        nonce = a.acquire(parcel, host="laptop")["nonce"]
        version, tags, blobs = make_version(a, parcel, nonce, parent=0)
        # Everything written through one server is visible through the other.
        assert b.parcel(parcel)["current_version"] == 1
        assert b.get_blob(parcel, 1, "manifest") == blobs["manifest"]
        assert all(b.has_chunk(t) for t in tags)
        with pytest.raises(LockHeld):
            b.acquire(parcel, host="desktop")
        b.release(parcel, nonce)  # the nonce from server A works on server B
        assert a.lock_status(parcel)["locked"] is False
        # A token made on one server is good on the other, and revoking it on one revokes it on both.
        b.logout()


def test_concurrent_acquires_on_two_servers(two_servers: tuple[ServerEnv, ServerProcess]) -> None:
    env, other = two_servers
    with env.client("alice") as a, other.client(token=env.tokens["alice"]) as b:
        a.health()
        b.health()
        outcomes = []
        for round_number in range(ROUNDS):
            parcel = env.new_parcel("alice")
            barrier = threading.Barrier(2)
            results: dict[str, str] = {}

            def contend(name: str, client: object) -> None:
                barrier.wait(timeout=30)
                try:
                    client.acquire(parcel, host=name)  # type: ignore[attr-defined]
                    results[name] = "won"
                except LockHeld as e:
                    results[name] = "refused by " + e.holder["host"]

            threads = [threading.Thread(target=contend, args=("via-a", a)),
                       threading.Thread(target=contend, args=("via-b", b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert sorted(results) == ["via-a", "via-b"], results
            winners = [name for name, outcome in results.items() if outcome == "won"]
            assert len(winners) == 1, (round_number, results)
            loser = "via-b" if winners[0] == "via-a" else "via-a"
            assert results[loser] == f"refused by {winners[0]}"
            outcomes.append(winners[0])
    # Both servers took part: with real concurrency each one wins some rounds (not required, reported).
    print(f"lock race winners over {ROUNDS} rounds: {outcomes.count('via-a')} via A, {outcomes.count('via-b')} via B")


def test_redirect_to_presigned_s3_urls(two_servers: tuple[ServerEnv, ServerProcess], tmp_path: Path) -> None:
    """A third server on the same backends with chunk_serving = redirect: chunk GETs answer 307 to a
    presigned URL on the S3 server, which the client follows (its bearer token is not sent there)."""
    env, _ = two_servers
    third = ServerProcess(env.config, tmp_path / "redirect.log", extra_args=("--set", "server.chunk_serving=redirect"))
    try:
        third.start()
        tag, data = make_chunk(20000)
        with third.client(token=env.tokens["alice"]) as client:
            client.put_chunk(tag, data)
            first = client.client.get(f"/v1/chunks/{tag}", headers={"Authorization": f"Bearer {client.token}"},
                                      follow_redirects=False)
            assert first.status_code == 307 and "X-Amz-Signature" in first.headers["location"]
            assert client.get_chunk(tag) == data
    finally:
        third.stop()


def test_token_revoked_on_one_server_is_refused_by_the_other(two_servers: tuple[ServerEnv, ServerProcess]) -> None:
    """Chunk reads trust a checked token for server.token_cache_seconds per worker (doc/server.md); every
    other request checks the database, so it is refused at once (and a refusal empties that worker's cache,
    which is why the chunk reads are polled first here)."""
    env, other = two_servers
    with env.server.client() as a:
        token = a.login("alice", PASSWORDS["alice"], label="revoked")
        tag, data = make_chunk(3000)
        with other.client(token=token) as b:
            b.put_chunk(tag, data)
            for _ in range(20):  # both of B's workers have checked the token and cached it
                assert b.get_chunk(tag) == data
            a.logout()
            revoked = time.monotonic()
            refused_after = None
            while refused_after is None and time.monotonic() - revoked < TOKEN_CACHE_SECONDS + 30:
                try:
                    b.get_chunk(tag)  # (one HTTP/2 connection: one worker, whose cache has the token)
                    time.sleep(0.1)
                except AuthenticationFailed:
                    refused_after = time.monotonic() - revoked
            with pytest.raises(AuthenticationFailed):  # a request that is not a chunk read checks the database
                b.parcels()
    assert refused_after is not None, "server B still serves chunks to a revoked token"
    # The cache's expiry is a clock, not work: a slow machine does not stretch it, a few seconds of margin do.
    assert refused_after <= TOKEN_CACHE_SECONDS + 5, refused_after
    print(f"revoked on A: B refused chunk reads after {refused_after:.1f} s (token_cache_seconds = "
          f"{TOKEN_CACHE_SECONDS}), and every other request at once")


@pytest.mark.timeout(900)
def test_isr_checks_in_through_one_server_and_resumes_through_the_other_while_gc_runs(
        two_servers: tuple[ServerEnv, ServerProcess], guest_artifacts: GuestArtifacts,  # noqa: F811
        tmp_path: Path) -> None:
    """The real isr: a parcel made and checked in through server A is resumed through server B and checked in
    there while gc (beside A, a grace of 5 s) runs in a loop; then it resumes through A where B left it, and fsck
    finds every version whole."""
    env, other = two_servers
    a_address = env.server.url.removeprefix("https://")
    b_address = other.url.removeprefix("https://")
    isr_env = IsrEnv(server=env, guest=guest_artifacts, root=tmp_path, port=int(a_address.rsplit(":", 1)[1]))
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path / "sites", ["via-a", "via-b"], servers=[a_address, b_address]) as (at_a, at_b):
        marks = work_and_check_in(at_a, parcel, "a1")

        # gc in a loop on server A's backends (what `isr-admin gc --grace 5` does) while server B takes the
        # uploads and the commit. A short grace: the chunks B's vulpes wrote back during the session are older
        # and fair game, and a commit that finds one gone makes isr upload it again (a grace of 0 would let gc
        # take every chunk again between that upload and the commit, for ever).
        stop = threading.Event()
        gc_runs: list[dict[str, object]] = []
        failures: list[BaseException] = []

        def collect() -> None:
            meta, store = env.open_backends()
            try:
                while not stop.wait(0.1):
                    gc_runs.append(ops.gc(meta, store, grace=GC_GRACE))
            except BaseException as exc:  # reported below
                failures.append(exc)
            finally:
                meta.close()
                store.close()

        # Chunks no version will reference, older than the grace when gc starts: it has work to do.
        with other.client(token=env.tokens.get("alice") or env.client("alice").token) as b:
            garbage = dict(make_chunk(2000) for _ in range(5))
            for tag, data in garbage.items():
                b.put_chunk(tag, data)
        meta, store = env.open_backends()
        try:
            wait_until(lambda: ops.gc(meta, store, grace=GC_GRACE, dry_run=True)["candidates"] >= len(garbage),
                       60, "the unreferenced chunks to age past the grace")
        finally:
            meta.close()
            store.close()
        collector = threading.Thread(target=collect, name="gc", daemon=True)
        collector.start()
        try:
            marks = work_and_check_in(at_b, parcel, "b1", before=marks)
        finally:
            stop.set()
            collector.join(timeout=150)
        assert gc_runs and not failures, failures
        deleted = sum(int(str(run["deleted"])) for run in gc_runs)
        assert deleted >= len(garbage), (deleted, gc_runs[-1])

        at_a.resume(parcel, "--policy", "demand")
        try:
            with at_a.console(parcel) as console:
                check_continues(console, marks)
        except Exception as e:
            pytest.fail(f"resumed through A after B's checkin: {e}{at_a.logs()}")
        at_a.isr("suspend", parcel.name, "--no-checkin")
        at_a.wait_session_end(parcel)
    assert isr_env.current_version(parcel) == 3
    fsck = env.admin("fsck")
    print(f"gc ran {len(gc_runs)} times during the checkin through B and deleted {deleted} chunks; "
          f"fsck: {fsck.stdout.strip()}")
