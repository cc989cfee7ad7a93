"""isr-admin against a real server and real backends: users, parcels made from disk images that a client
then fetches and decrypts over the API, versions, locks, gc, fsck and usage."""
from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from isrctl.remote import AuthenticationFailed, ChunksMissing, LockHeld, LockLost, Remote
from tests.server_fixtures import (ServerEnv, image_with_data, postgres_dsn, s3_server,  # noqa: F401
                                   server_env)
from tests.test_server_api import make_chunk

pytestmark = pytest.mark.timeout(180)

PASSPHRASE = "correct horse battery staple"


def fetch_and_decrypt(client: Remote, parcel: str, passphrase: str, version: int | None = None
                      ) -> tuple[bytes, object]:
    """What a client does: key envelope, manifest, keyrings and chunks over the API, all decrypted and
    checked with the parcels library. Returns (disk image bytes, manifest)."""
    from parcels.chunk import chunk_length, decode_chunk
    from parcels.envelope import unwrap_envelope
    from parcels.keyring import unwrap_chunk_key
    from parcels.manifest import open_keyring, open_manifest

    _, parcel_key, _secret = unwrap_envelope(client.key_envelope(parcel), passphrase=passphrase,
                                             expect_uuid=uuid.UUID(parcel))
    if version is None:
        version = client.parcel(parcel)["current_version"]
    manifest = open_manifest(parcel_key, client.get_blob(parcel, version, "manifest"), parcel=uuid.UUID(parcel),
                             version=version)
    records = open_keyring(parcel_key, client.get_blob(parcel, version, "keyring.disk"), manifest, "disk")
    size = manifest.images["disk"].size
    disk = bytearray(size)
    for record in records:
        length = chunk_length(record.idx, manifest.chunk_size, size)
        plain = decode_chunk(client.get_chunk(record.tag.hex()), record.tag, unwrap_chunk_key(parcel_key, record.wkey),
                             length)
        disk[record.idx * manifest.chunk_size:record.idx * manifest.chunk_size + length] = plain
    assert open_keyring(parcel_key, client.get_blob(parcel, version, "keyring.memory"), manifest, "memory") == []
    return bytes(disk), manifest


def commit_resealed_version(client: Remote, parcel: str, passphrase: str) -> dict:
    """Commit a new version the way a client does after a session without disk writes: a new sealed
    manifest, the keyrings inherited from the parent, the same chunks referenced."""
    import dataclasses

    from parcels.envelope import unwrap_envelope
    from parcels.manifest import open_keyring, open_manifest, seal_manifest

    _, parcel_key, _ = unwrap_envelope(client.key_envelope(parcel), passphrase=passphrase,
                                       expect_uuid=uuid.UUID(parcel))
    current = client.parcel(parcel)["current_version"]
    manifest = open_manifest(parcel_key, client.get_blob(parcel, current, "manifest"), parcel=uuid.UUID(parcel),
                             version=current)
    tags = [r.tag.hex() for name in ("disk", "memory")
            for r in open_keyring(parcel_key, client.get_blob(parcel, current, f"keyring.{name}"), manifest, name)]
    nonce = client.acquire(parcel, host="laptop", site="home")["nonce"]
    assert client.missing(tags) == []
    sealed = seal_manifest(parcel_key, dataclasses.replace(manifest, version=current + 1, parent=current))
    client.put_blob(parcel, "manifest", sealed, nonce)
    version = client.commit(parcel, nonce, current, ["manifest"], tags, inherit=["keyring.disk", "keyring.memory"])
    client.release(parcel, nonce)
    return version


def create(env: ServerEnv, tmp_path: Path, owner: str, name: str, disk: Path, *extra: str) -> dict:
    pp = tmp_path / f"{name}.pass"
    pp.write_text(PASSPHRASE + "\n")
    return env.admin_json("parcel", "create", "--owner", owner, "--name", name, "--disk", str(disk), "--ram", "16",
                          "--passphrase-file", str(pp), "--scrypt-log2n", "10", "--force", *extra)


def test_users(server_env: ServerEnv, tmp_path: Path) -> None:
    env = server_env
    env.admin("user", "add", "carol", "--password-file", "-", input_text="first\n")
    users = {u["user"]: u for u in env.admin_json("user", "list")}
    assert "carol" in users and users["root"]["admin"] is True and users["carol"]["admin"] is False
    header, *lines = env.admin("user", "list").stdout.splitlines()  # the table for people
    rows = {line.split()[0]: line.split() for line in lines}
    assert header.split() == ["USER", "ADMIN", "PARCELS", "CREATED"]
    assert rows["root"][1] == "yes" and rows["carol"][1] == "0" and rows["carol"][3].endswith("Z"), lines
    with env.server.client() as client:
        client.login("carol", "first")
        env.admin("user", "password", "carol", "--password-file", "-", input_text="second\n")
        with pytest.raises(AuthenticationFailed):
            client.whoami()  # changing the password revoked the token
        with pytest.raises(AuthenticationFailed):
            client.login("carol", "first")
        client.login("carol", "second")
    duplicate = env.admin("user", "add", "carol", "--password-file", "-", input_text="x\n", check=False)
    assert duplicate.returncode == 1 and duplicate.stderr.startswith("isr-admin: ") and duplicate.stderr.count("\n") == 1
    env.admin("user", "remove", "carol")
    assert "carol" not in {u["user"] for u in env.admin_json("user", "list")}
    bad = env.admin("user", "add", "Bad/Name", "--password-file", "-", input_text="x\n", check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1


def test_create_from_raw_image_then_client_decrypts(server_env: ServerEnv, tmp_path: Path) -> None:
    disk = tmp_path / "disk.raw"
    content = image_with_data(disk, 3 * 1024 * 1024, seed=1, data_ranges=[(0, 200000), (1048576 + 5, 70000),
                                                                            (3 * 1024 * 1024 - 512, 512)])
    info = create(server_env, tmp_path, "alice", "raw-ws", disk, "--machine", "pc-q35-7.2")
    parcel = info["id"]
    assert info["current_version"] == 1 and info["owner"] == "alice" and info["lock"] is None
    with server_env.client("alice") as client:
        assert parcel in [p["id"] for p in client.parcels()]
        got, manifest = fetch_and_decrypt(client, parcel, PASSPHRASE)
        assert got == content
        assert manifest.vm.ram_mib == 16 and manifest.vm.machine == "pc-q35-7.2" and manifest.name == "raw-ws"
    with server_env.client("bob") as bob:
        assert parcel not in [p["id"] for p in bob.parcels()]


def test_create_from_qcow2_image(server_env: ServerEnv, tmp_path: Path) -> None:
    raw = tmp_path / "src.raw"
    content = image_with_data(raw, 2 * 1024 * 1024, seed=2, data_ranges=[(4096, 300000)])
    qcow = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(raw), str(qcow)], check=True,
                   timeout=60)
    parcel = create(server_env, tmp_path, "bob", "qcow-ws", qcow)["id"]
    with server_env.client("bob") as client:
        got, _ = fetch_and_decrypt(client, parcel, PASSPHRASE)
    assert got == content


def test_versions_prune_rollback_copy(server_env: ServerEnv, tmp_path: Path) -> None:
    env = server_env
    disk = tmp_path / "disk.raw"
    first = image_with_data(disk, 1024 * 1024, seed=3, data_ranges=[(0, 100000)])
    parcel = create(env, tmp_path, "alice", "hist", disk)["id"]
    pp = tmp_path / "hist.pass"
    refused = env.admin("version", "rollback", parcel, "1", "--passphrase-file", str(pp), check=False)
    assert refused.returncode == 1 and "already the current version" in refused.stderr
    with env.client("alice") as client:
        commit_resealed_version(client, parcel, PASSPHRASE)  # version 2, as a client that saved again
    # Rolling back to version 1 twice gives versions 3 and 4, each with version 1's content.
    for expected in (3, 4):
        out = env.admin_json("version", "rollback", parcel, "1", "--passphrase-file", str(pp))
        assert out["version"] == expected
    versions = env.admin_json("version", "list", "alice/hist")
    assert [v["version"] for v in versions] == [1, 2, 3, 4]
    assert versions[3]["parent"] == 3
    with env.client("alice") as client:
        got, manifest = fetch_and_decrypt(client, parcel, PASSPHRASE, version=4)
        assert got == first and manifest.version == 4 and manifest.parent == 3
        # A rollback respects a client's lock.
        nonce = client.acquire(parcel, host="laptop")["nonce"]
        refused = env.admin("version", "rollback", parcel, "1", "--passphrase-file", str(pp), check=False)
        assert refused.returncode == 1 and "locked" in refused.stderr
        client.release(parcel, nonce)
    pruned = env.admin_json("version", "prune", parcel, "--keep", "2")
    assert pruned["deleted"] == [1, 2]
    assert [v["version"] for v in env.admin_json("version", "list", parcel)] == [3, 4]
    copy = env.admin_json("parcel", "copy", parcel, "--owner", "bob", "--name", "hist-copy", "--passphrase-file",
                          str(pp), "--scrypt-log2n", "10")
    assert copy["owner"] == "bob" and copy["current_version"] == 1 and copy["id"] != parcel
    with env.client("bob") as bob:
        got, manifest = fetch_and_decrypt(bob, copy["id"], PASSPHRASE)
        assert got == first and str(manifest.parcel) == copy["id"] and manifest.version == 1
    show = env.admin_json("parcel", "show", "bob/hist-copy")
    assert show["id"] == copy["id"]
    env.admin("parcel", "remove", copy["id"])
    assert copy["id"] not in [p["id"] for p in env.admin_json("parcel", "list")]


def test_lock_show_and_break(server_env: ServerEnv, tmp_path: Path) -> None:
    env = server_env
    parcel = env.new_parcel("alice", "lockme")
    with env.client("alice") as client:
        nonce = client.acquire(parcel, host="laptop.example", site="home")["nonce"]
        shown = env.admin_json("lock", "show", parcel)
        assert shown[0]["lock"]["host"] == "laptop.example" and shown[0]["lock"]["site"] == "home"
        assert parcel in [item["parcel"] for item in env.admin_json("lock", "show")]
        header, row = env.admin("lock", "show", parcel).stdout.splitlines()  # the table for people
        assert header.split() == ["PARCEL", "OWNER/NAME", "HOLDER", "HOST", "SITE", "SINCE", "VERSION", "EXPIRES"]
        assert row.split()[:5] == [parcel, "alice/lockme", "alice", "laptop.example", "home"], row
        refused = env.admin("parcel", "remove", parcel, check=False)
        assert refused.returncode == 1
        broken = env.admin_json("lock", "break", "alice/lockme", "--reason", "stolen laptop")
        assert broken["broken"]["host"] == "laptop.example"
        with pytest.raises(LockLost):
            client.renew(parcel, nonce)
        again = client.acquire(parcel, host="desktop")
        with pytest.raises(LockHeld):
            client.acquire(parcel, host="third")
        client.release(parcel, again["nonce"])
    audit = env.admin_json("audit", "--parcel", parcel)
    assert any(e["action"] == "lock.break" and e["actor"] == "isr-admin" for e in audit)


def test_gc_fsck_usage(server_env: ServerEnv, tmp_path: Path) -> None:
    env = server_env
    disk = tmp_path / "disk.raw"
    image_with_data(disk, 1024 * 1024, seed=4, data_ranges=[(0, 300000)])
    parcel = create(env, tmp_path, "alice", "gcme", disk)["id"]
    orphan_tag, orphan = make_chunk(3000)
    with env.client("alice") as client:
        client.put_chunk(orphan_tag, orphan)
        referenced = client.version(parcel, 1)["chunk_count"]
        assert referenced > 0
        # With the default grace period nothing young is deleted.
        kept = env.admin_json("gc")
        assert kept["deleted"] == 0
        assert client.has_chunk(orphan_tag)
        stats = env.admin_json("gc", "--grace", "0")
        assert stats["deleted"] >= 1
        assert not client.has_chunk(orphan_tag)
        got, _ = fetch_and_decrypt(client, parcel, PASSPHRASE)  # referenced chunks survive
        # The chunk can be uploaded again after gc took it.
        assert client.missing([orphan_tag]) == [orphan_tag]
        assert client.put_chunk(orphan_tag, orphan) is True
    report = env.admin_json("fsck")
    assert report["ok"] is True and report["chunks_checked"] >= referenced
    usage = env.admin_json("usage")
    alice = usage["users"]["alice"]
    assert alice["parcels"] >= 1 and alice["logical_bytes"] >= alice["unique_chunk_bytes"] > 0
    assert usage["chunk_bytes"] > 0 and usage["dedup_ratio"] > 0


def test_fsck_finds_corrupt_and_missing_chunks(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """On a private directory-backed server, so damaging files does not disturb the other tests."""
    from tests.server_fixtures import start_env

    env = start_env("sqlite-directory", tmp_path / "srv", request)
    try:
        disk = tmp_path / "disk.raw"
        image_with_data(disk, 1024 * 1024, seed=5, data_ranges=[(0, 400000)])
        parcel = create(env, tmp_path, "alice", "damaged", disk)["id"]
        chunk_files = sorted((tmp_path / "srv" / "data" / "store" / "chunks").glob("*/*/*"))
        assert len(chunk_files) >= 2
        corrupt, missing = chunk_files[0], chunk_files[1]
        corrupt.write_bytes(b"not what the tag says")
        missing.unlink()
        result = env.admin("--json", "fsck", check=False)
        assert result.returncode == 1
        report = json.loads(result.stdout)
        assert report["corrupt"] == [corrupt.name] and report["missing"] == [missing.name]
        assert report["incomplete_versions"][0]["parcel"] == parcel
        human = env.admin("fsck", check=False)
        assert "corrupt chunk" in human.stdout and "PROBLEMS FOUND" in human.stdout
        # A client re-upload after repair heals the store.
        env.admin("--json", "fsck", "--repair", check=False)
        with env.client("alice") as client:
            with pytest.raises(ChunksMissing):
                nonce = client.acquire(parcel, host="h")["nonce"]
                for name in ("manifest", "keyring.disk", "keyring.memory"):
                    client.put_blob(parcel, name, b"x", nonce)
                client.commit(parcel, nonce, 1, ["manifest", "keyring.disk", "keyring.memory"],
                              [corrupt.name])
    finally:
        env.server.stop()


def test_errors_are_one_line(server_env: ServerEnv, tmp_path: Path) -> None:
    env = server_env
    for args in (("parcel", "show", "nobody/nothing"), ("parcel", "show", "not-a-uuid"),
                 ("version", "list", "00000000-0000-4000-8000-000000000000"),
                 ("parcel", "create", "--owner", "alice", "--name", "x", "--disk", str(tmp_path / "absent.img"),
                  "--ram", "16", "--passphrase-file", "/nonexistent")):
        result = env.admin(*args, check=False)
        assert result.returncode == 1, args
        assert result.stderr.startswith("isr-admin: ") and result.stderr.count("\n") == 1, result.stderr
        assert "Traceback" not in result.stderr
    if env.settings.get("metadata.backend", "sqlite") == "sqlite":
        # A mistyped --data-dir names no database: refused in one line, nothing created there. Only
        # `user add`, the first step on a new server, starts a database, and says so.
        typo = tmp_path / "srv-typo"
        for args in (("parcel", "list"), ("user", "list"), ("gc",), ("lock", "show")):
            result = env.admin("--data-dir", str(typo), *args, check=False)
            assert result.returncode == 1 and result.stderr.count("\n") == 1, (args, result.stderr)
            assert str(typo / "meta.sqlite") in result.stderr and "--data-dir" in result.stderr, result.stderr
            assert not typo.exists(), args
        result = env.admin("--data-dir", str(typo), "user", "add", "carol", "--password-file", "-",
                           input_text="carol-password\n")
        assert "new, empty database" in result.stderr and str(typo / "meta.sqlite") in result.stderr
        assert [u["user"] for u in json.loads(env.admin("--data-dir", str(typo), "--json", "user", "list").stdout)] \
            == ["carol"]
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text("[server]\nworkers = 'two'\n")
    result = subprocess.run([str(Path(os.sys.executable).parent / "isr-server"), "-c", str(bad_config)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and result.stderr.strip() == \
        f"isr-server: server.workers ({bad_config}): expected an integer, got 'two'"
    bad_config.write_bytes(b"[server]\nworkers = 2 # caf\xe9\n")
    result = subprocess.run([str(Path(os.sys.executable).parent / "isr-server"), "-c", str(bad_config)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert str(bad_config) in result.stderr and "UTF-8" in result.stderr, result.stderr
    password = tmp_path / "password"
    password.write_bytes(b"s\xe9cret\n")
    result = env.admin("user", "add", "latin1", "--password-file", str(password), check=False)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert str(password) in result.stderr and "UTF-8" in result.stderr, result.stderr


@pytest.mark.parametrize("server_env", ["postgres-s3"], indirect=True)   # an S3 store only, not skipped
def test_missing_s3_bucket_is_named_with_how_to_create_it(server_env: ServerEnv, tmp_path: Path) -> None:
    """A store.bucket that does not exist (a typo, or never made): isr-server and isr-admin say which bucket
    at which endpoint, and how to create it, in one line."""
    assert server_env.settings.get("store.backend") == "s3"
    missing = f"isr-missing-{uuid.uuid4().hex[:8]}"
    endpoint = server_env.settings["store.endpoint"]
    disk = tmp_path / "disk.raw"
    image_with_data(disk, 1024 * 1024, seed=9, data_ranges=[(0, 5000)])
    (tmp_path / "pass").write_text(PASSPHRASE + "\n")
    server = subprocess.run([str(Path(os.sys.executable).parent / "isr-server"), "-c", str(server_env.config),
                             "--set", f"store.bucket={missing}", "--listen", "127.0.0.1:0"],
                            capture_output=True, text=True, timeout=60)
    admin = server_env.admin("--set", f"store.bucket={missing}", "parcel", "create", "--owner", "alice", "--name",
                             "nobucket", "--disk", str(disk), "--ram", "16", "--passphrase-file",
                             str(tmp_path / "pass"), "--scrypt-log2n", "10", "--force", check=False)
    for result in (server, admin):
        error = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        assert result.returncode == 1, (result.returncode, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        assert f"bucket {missing}" in error and endpoint in error and "create it" in error, result.stderr
    assert "nobucket" not in server_env.admin("parcel", "list").stdout
