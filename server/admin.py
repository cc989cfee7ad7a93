"""isr-admin: manage an ISR server's users, parcels, versions, locks and storage.

It reads the same configuration as isr-server and works directly on the metadata database and the object
store, so it needs no running server. Everything that changes a parcel's versions takes the parcel's lock
like a client does. ``--json`` prints machine-readable output; errors are one line on stderr. Long work
(create, gc, fsck) shows its progress through `isrprogress`: bars on a terminal, plain lines otherwise, on
stdout (on stderr with ``--json``, which keeps stdout for the JSON).
"""
from __future__ import annotations

import argparse
import datetime
import getpass
import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from isrprogress import Reporter, TerminalReporter, human_bytes as size
from parcels import devices
from parcels import qemuimg
from parcels.chunk import DEFAULT_CHUNK_SIZE
from parcels.errors import ParcelError
from parcels.manifest import FIRMWARES
from parcels.secretsource import read_key_file, read_secret

from . import auth, names, ops, tls
from .config import Config
from .errors import ApiError, ServerError
from .main import VERSION_TEXT, load_config
from .meta import open_meta
from .meta.sql import SqlMeta
from .store import ObjectStore, open_store


class AdminError(ServerError):
    """A wrong use of isr-admin (a missing password, an unreadable file)."""


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip()]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _password(args: argparse.Namespace, what: str = "password") -> str:
    password = read_secret(file=args.password_file, env=args.password_env, option="--password")
    if password is not None:
        return password
    if not sys.stdin.isatty():
        raise AdminError(f"give --password-file FILE|- or --password-env VAR (or run on a terminal to be asked "
                         f"for the {what})")
    first = getpass.getpass(f"new {what}: ")
    if first != getpass.getpass("again: "):
        raise AdminError(f"the two {what}s differ")
    if not first:
        raise AdminError(f"the {what} must not be empty")
    return first


def _credential(args: argparse.Namespace, prompt: str, prefix: str = "", required: bool = True
                ) -> tuple[str | None, bytes | None]:
    """A parcel passphrase (from --{prefix}passphrase-file or -env, or asked for) or a key file's contents."""
    dest = prefix.replace("-", "_")
    key_file = getattr(args, f"{dest}key_file")
    if key_file:
        return None, read_key_file(key_file, f"--{prefix}key-file")
    passphrase = read_secret(file=getattr(args, f"{dest}passphrase_file"), env=getattr(args, f"{dest}passphrase_env"),
                             option=f"--{prefix}passphrase")
    if passphrase is not None or not required:
        return passphrase, None
    if not sys.stdin.isatty():
        raise AdminError("give --passphrase-file FILE|-, --passphrase-env VAR or --key-file FILE (or run on a "
                         "terminal to be asked)")
    return getpass.getpass(prompt), None


class Admin:
    """The command implementations; each returns a JSON-able value and prints a human form unless --json."""

    def __init__(self, config: Config, as_json: bool, *, may_create: bool = False) -> None:
        self.config = config
        self.as_json = as_json
        self.may_create = may_create
        self._meta: SqlMeta | None = None
        self._store: ObjectStore | None = None
        self.reporter: Reporter = TerminalReporter(sys.stderr if as_json else sys.stdout)

    @property
    def meta(self) -> SqlMeta:
        if self._meta is None:
            path = self.config.sqlite_path
            if self.config["metadata.backend"] == "sqlite" and not path.exists():
                # A mistyped --data-dir or -c must not quietly start an empty server.
                if not self.may_create:
                    raise AdminError(f"there is no ISR database {path}: check --data-dir, -c or metadata.path "
                                     f"(`isr-admin user add` starts a new server's database)")
                print(f"isr-admin: starting a new, empty database {path}", file=sys.stderr)
            meta = open_meta(self.config)
            assert isinstance(meta, SqlMeta)
            self._meta = meta
        return self._meta

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = open_store(self.config)
        return self._store

    def close(self) -> None:
        if self._meta is not None:
            self._meta.close()
        if self._store is not None:
            self._store.close()

    def out(self, value: Any, human: Callable[[], str]) -> None:
        if self.as_json:
            print(json.dumps(value, indent=2, sort_keys=True))
        else:
            text = human()
            if text:
                print(text)

    def parcel_id(self, text: str) -> str:
        """A parcel by UUID or as owner/name."""
        if "/" in text:
            owner, _, name = text.partition("/")
            return self.meta.find_parcel(owner, name).id
        return self.meta.get_parcel(names.parcel_id(text)).id

    # --- users ------------------------------------------------------------------------------------

    def user_add(self, args: argparse.Namespace) -> None:
        name = names.user_name(args.name)
        user = self.meta.add_user(name, auth.hash_password(_password(args)), admin=args.admin)
        self.out({"user": user.name, "admin": user.admin, "created": user.created},
                 lambda: f"added user {user.name}{' (administrator)' if user.admin else ''}")

    def user_remove(self, args: argparse.Namespace) -> None:
        self.meta.remove_user(args.name)
        self.out({"removed": args.name}, lambda: f"removed user {args.name}")

    def user_password(self, args: argparse.Namespace) -> None:
        if self.meta.get_user(args.name) is None:
            raise AdminError(f"no user {args.name}")
        self.meta.set_password(args.name, auth.hash_password(_password(args)))
        self.out({"user": args.name, "password": "changed", "tokens": "revoked"},
                 lambda: f"changed the password of {args.name} and revoked their tokens")

    def user_list(self, args: argparse.Namespace) -> None:
        users = self.meta.list_users()
        counts: dict[str, int] = {}
        for parcel in self.meta.list_parcels():
            counts[parcel.owner] = counts.get(parcel.owner, 0) + 1
        data = [{"user": u.name, "admin": u.admin, "created": u.created, "parcels": counts.get(u.name, 0)}
                for u in users]
        self.out(data, lambda: _table([[u.name, "yes" if u.admin else "", str(counts.get(u.name, 0)), _when(u.created)]
                                        for u in users], ["USER", "ADMIN", "PARCELS", "CREATED"]))

    # --- parcels ----------------------------------------------------------------------------------

    def parcel_create(self, args: argparse.Namespace) -> None:
        names.user_name(args.owner)
        names.parcel_name(args.name)
        passphrase, keyfile = _credential(args, f"passphrase for {args.name}: ")
        vm: dict[str, Any] = {}
        if args.vm:
            try:
                vm = json.loads(Path(args.vm).read_text() if Path(args.vm).is_file() else args.vm)
            except (OSError, ValueError) as e:
                raise AdminError(f"--vm must be a JSON object or a file holding one: {e}") from None
            if not isinstance(vm, dict):
                raise AdminError("--vm must be a JSON object")
        for key in ("machine", "cpu", "smp"):
            if getattr(args, key) is not None:
                vm[key] = getattr(args, key)
        boot: dict[str, Any] = {}
        if args.kernel:
            boot = {"kernel": args.kernel, "initrd": args.initrd, "cmdline": args.cmdline or ""}
        parcel = ops.create_parcel(self.meta, self.store, owner=args.owner, name=args.name, disk=args.disk,
                                   ram_mib=args.ram, passphrase=passphrase, keyfile=keyfile, vm=vm or None,
                                   boot=boot or None, chunk_size=args.chunk_size,
                                   memory_chunk_size=args.memory_chunk_size, log2n=args.scrypt_log2n,
                                   reporter=self.reporter, disk_format=args.format, firmware=args.firmware,
                                   force=args.force)
        self.out(self._parcel_json(parcel), lambda: f"created parcel {parcel} ({args.owner}/{args.name}), version 1")

    def _parcel_json(self, parcel: str) -> dict[str, Any]:
        info = self.meta.get_parcel(parcel)
        data = info.to_json()
        data["owner"] = info.owner
        data["versions"] = [v.to_json() for v in self.meta.list_versions(parcel)]
        return data

    def parcel_list(self, args: argparse.Namespace) -> None:
        owner_id = None
        if args.owner:
            found = self.meta.get_user(args.owner)
            if found is None:
                raise AdminError(f"no user {args.owner}")
            owner_id = found[0].id
        parcels = self.meta.list_parcels(owner_id)
        data = [p.to_json() for p in parcels]
        self.out(data, lambda: _table(
            [[p.id, p.owner, p.name, str(p.current_version),
              f"{p.lock.user}@{p.lock.host}" + (" (expired)" if p.lock.expired() else "") if p.lock else "-"]
             for p in parcels], ["PARCEL", "OWNER", "NAME", "VERSION", "LOCK"]))

    def parcel_show(self, args: argparse.Namespace) -> None:
        data = self._parcel_json(self.parcel_id(args.parcel))

        def human() -> str:
            lock = data["lock"]
            lines = [f"parcel   {data['id']}", f"owner    {data['owner']}", f"name     {data['name']}",
                     f"created  {_when(data['created'])}", f"current  {data['current_version']}",
                     "lock     " + (f"{lock['user']} on {lock['host']} ({lock['site']}) since {_when(lock['acquired'])}"
                                   f" at version {lock['version']}" + (" EXPIRED" if lock["expired"] else "")
                                   if lock else "-"),
                     "", self._versions_table(data["versions"])]
            return "\n".join(lines)

        self.out(data, human)

    def parcel_copy(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel)
        names.user_name(args.owner)
        names.parcel_name(args.name)
        passphrase, keyfile = _credential(args, "passphrase of the source parcel: ")
        new_pass, new_key = _credential(args, "", "new-", required=False)
        new = ops.copy_parcel(self.meta, self.store, parcel, owner=args.owner, name=args.name, passphrase=passphrase,
                              keyfile=keyfile, new_passphrase=new_pass, new_keyfile=new_key, log2n=args.scrypt_log2n)
        self.out(self._parcel_json(new), lambda: f"copied {parcel} to {new} ({args.owner}/{args.name})")

    def parcel_remove(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel)
        ops.remove_parcel(self.meta, self.store, parcel, force=args.force)
        self.out({"removed": parcel}, lambda: f"removed parcel {parcel} (run gc to free its chunks)")

    def parcel_set(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel)
        changes: dict[str, str] = {}
        if args.forward is not None or args.no_forwards:
            try:
                changes[devices.FORWARD] = devices.format_forwards(devices.parse_forwards(args.forward or []))
            except ParcelError as e:
                raise AdminError(str(e)) from None
        for role in ("net", "rng"):
            if getattr(args, role) is not None:
                changes[role] = getattr(args, role)
        if not changes:
            raise AdminError("nothing to set: give --forward, --no-forwards, --net or --rng")
        passphrase, keyfile = _credential(args, "passphrase: ")
        new = ops.set_devices(self.meta, self.store, parcel, changes, passphrase=passphrase, keyfile=keyfile)
        self.out({"parcel": parcel, "version": new, "devices": changes},
                 lambda: f"version {new} of {parcel} has " + ", ".join(f"{k}={v or '(none)'}" for k, v in changes.items()))

    # --- versions ---------------------------------------------------------------------------------

    @staticmethod
    def _versions_table(versions: list[dict[str, Any]]) -> str:
        return _table([[str(v["version"]), _when(v["created"]), v["user"], f"{v['host']} ({v['site']})",
                        str(v["chunk_count"]), size(v["chunk_bytes"])] for v in versions],
                      ["VERSION", "CREATED", "BY", "FROM", "CHUNKS", "BYTES"])

    def version_list(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel)
        data = [v.to_json() for v in self.meta.list_versions(parcel)]
        self.out(data, lambda: self._versions_table(data))

    def version_prune(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel)
        deleted = ops.prune(self.meta, self.store, parcel, args.keep)
        self.out({"parcel": parcel, "deleted": deleted},
                 lambda: f"deleted versions {', '.join(map(str, deleted))} (run gc to free chunks)" if deleted
                 else "nothing to prune")

    def version_rollback(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel)
        passphrase, keyfile = _credential(args, "passphrase: ")
        new = ops.rollback(self.meta, self.store, parcel, args.version, passphrase=passphrase, keyfile=keyfile,
                           force=args.force)
        self.out({"parcel": parcel, "version": new, "content_of": args.version},
                 lambda: f"version {new} of {parcel} now holds the content of version {args.version}")

    # --- locks ------------------------------------------------------------------------------------

    def lock_show(self, args: argparse.Namespace) -> None:
        if args.parcel:
            parcels = [self.meta.get_parcel(self.parcel_id(args.parcel))]
        else:
            parcels = [p for p in self.meta.list_parcels() if p.lock is not None]
        data = [{"parcel": p.id, "owner": p.owner, "name": p.name, "lock": p.lock.to_json() if p.lock else None}
                for p in parcels]
        self.out(data, lambda: _table(
            [[p.id, f"{p.owner}/{p.name}"] + (
                [p.lock.user, p.lock.host, p.lock.site, _when(p.lock.acquired), str(p.lock.version),
                 _when(p.lock.expires) + (" (expired)" if p.lock.expired() else "")]
                if p.lock else ["-", "", "", "", "", ""]) for p in parcels],
            ["PARCEL", "OWNER/NAME", "HOLDER", "HOST", "SITE", "SINCE", "VERSION", "EXPIRES"]))

    def lock_break(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel)
        old = self.meta.break_lock(parcel, ops.ADMIN_ACTOR, "", args.reason or "admin")
        self.store.delete_prefix(f"staging/{parcel}/{old.lock_id}/")
        self.out({"parcel": parcel, "broken": old.to_json()},
                 lambda: f"broke the lock of {parcel} held by {old.user} on {old.host} since {_when(old.acquired)}")

    # --- storage ----------------------------------------------------------------------------------

    def gc(self, args: argparse.Namespace) -> None:
        grace = args.grace if args.grace is not None else self.config["server.gc_grace_seconds"]
        stats = ops.gc(self.meta, self.store, grace, reporter=self.reporter, dry_run=args.dry_run)
        self.out(stats, lambda: (f"{stats['candidates']} unreferenced chunk(s) older than {grace} s"
                                 if stats["dry_run"] else
                                 f"deleted {stats['deleted']} chunk(s), {size(stats['deleted_bytes'])}; "
                                 f"{stats['orphans_deleted']} orphan object(s), {stats['staging_deleted']} stale "
                                 f"staged blob(s)"))

    def fsck(self, args: argparse.Namespace) -> None:
        report = ops.fsck(self.meta, self.store, reporter=self.reporter, repair=args.repair)

        def human() -> str:
            lines = [f"checked {report['chunks_checked']} chunk object(s) and {report['versions_checked']} version(s)"]
            for tag in report["corrupt"]:
                lines.append(f"corrupt chunk {tag}")
            for tag in report["missing"]:
                lines.append(f"missing chunk {tag}")
            for tag in report["unindexed"]:
                lines.append(f"chunk {tag} is stored but not indexed (gc will remove it)")
            for item in report["incomplete_versions"]:
                lines.append(f"parcel {item['parcel']} version {item['version']}: {'; '.join(item['problems'])}")
            lines.append("ok" if report["ok"] else "PROBLEMS FOUND" + (" (repaired what could be)" if args.repair else ""))
            return "\n".join(lines)

        self.out(report, human)
        if not report["ok"]:
            raise SystemExit(1)

    def usage(self, args: argparse.Namespace) -> None:
        data = ops.usage(self.meta)

        def human() -> str:
            rows = [[name, str(u["parcels"]), str(u["versions"]), size(u["logical_bytes"]),
                     size(u["unique_chunk_bytes"]), size(u["blob_bytes"]),
                     f"{u['dedup_ratio']:.2f}" if u["dedup_ratio"] else "-"] for name, u in sorted(data["users"].items())]
            total = (f"stored: {data['chunks']} chunks, {size(data['chunk_bytes'])}; referenced by all versions: "
                     f"{size(data['logical_bytes'])}; dedup ratio "
                     + (f"{data['dedup_ratio']:.2f}" if data["dedup_ratio"] else "-"))
            return _table(rows, ["USER", "PARCELS", "VERSIONS", "LOGICAL", "UNIQUE", "BLOBS", "DEDUP"]) + "\n" + total

        self.out(data, human)

    # --- handing the server to users ---------------------------------------------------------------

    def _server_url(self, url: str | None, cert_hosts: list[str]) -> str:
        """The address users give `isr login`: --url, or server.listen with a wildcard host replaced by the
        certificate's first DNS name other than localhost (else this machine's name)."""
        if url:
            if not url.startswith("https://") or len(url) <= len("https://"):
                raise AdminError(f"--url must be https://HOST:PORT, got {url!r}")
            return url.rstrip("/")
        host, port = self.config.listen
        if port == 0:
            raise AdminError("server.listen picks a free port at each start (port 0): give --url https://HOST:PORT")
        if host in ("", "0.0.0.0", "::"):
            host = next((name for name in cert_hosts if name != "localhost" and "*" not in name), socket.getfqdn())
        return f"https://{f'[{host}]' if ':' in host else host}:{port}"

    def fingerprint(self, args: argparse.Namespace) -> None:
        cert = tls.certificate_path(self.config.data_dir, self.config["server.tls_cert"])
        if not self.config["server.tls_cert"] and not cert.is_file():
            raise AdminError(f"there is no certificate {cert} yet: isr-server makes a self-signed one at its first "
                             f"start (or set server.tls_cert and server.tls_key)")
        fingerprint = tls.fingerprint_file(cert)
        url = self._server_url(args.url, tls.certificate_hosts(cert))
        user = args.user or "NAME"
        if args.user:
            names.user_name(args.user)
            if self.meta.get_user(args.user) is None:
                raise AdminError(f"no user {args.user} (`isr-admin user add {args.user}` first)")
        login = f"isr login {url} --user {user} --fingerprint {fingerprint}"
        self.out({"certificate": str(cert), "fingerprint": fingerprint, "url": url, "user": args.user,
                  "login": login},
                 lambda: f"certificate {cert}\nfingerprint {fingerprint}\n\n{login}")

    def audit(self, args: argparse.Namespace) -> None:
        parcel = self.parcel_id(args.parcel) if args.parcel else None
        entries = self.meta.list_audit(parcel, args.limit)
        data = [e.to_json() for e in entries]
        self.out(data, lambda: "\n".join(
            f"{_when(e.at)} {e.actor} {e.action} {e.parcel or '-'} {e.remote or '-'} {json.dumps(e.detail, sort_keys=True)}"
            for e in entries))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isr-admin", description="Manage an ISR server's users, parcels and storage.")
    parser.add_argument("--version", action="version", version=VERSION_TEXT, help="print the version and exit")
    parser.add_argument("-c", "--config", help="the server's config file (default: $ISR_SERVER_CONFIG)")
    parser.add_argument("--data-dir", help="override server.data_dir")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE", help="override a setting")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    # Without a command (or a noun without its verb) the nearest parser's help is printed (`main`).
    parser.set_defaults(func=None, help_of=parser)
    top = parser.add_subparsers(dest="noun", metavar="COMMAND")

    def noun(name: str, help_text: str) -> Any:
        p = top.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(help_of=p)
        return p.add_subparsers(dest="verb", metavar="VERB")

    def cmd(sub: Any, name: str, func: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    def credentials(p: argparse.ArgumentParser, prefix: str = "") -> None:
        what = "the new parcel's" if prefix else "the parcel"
        group = p.add_mutually_exclusive_group()
        group.add_argument(f"--{prefix}passphrase-file", metavar="FILE|-",
                           help=f"take {what} passphrase from this file ('-': a line of stdin)")
        group.add_argument(f"--{prefix}passphrase-env", metavar="VAR",
                           help=f"take {what} passphrase from this variable")
        group.add_argument(f"--{prefix}key-file", metavar="FILE",
                           help=f"{what} is protected by this key file instead of a passphrase")

    def password(p: argparse.ArgumentParser) -> None:
        group = p.add_mutually_exclusive_group()
        group.add_argument("--password-file", metavar="FILE|-",
                           help="take the password from this file ('-': the first line of stdin)")
        group.add_argument("--password-env", metavar="VAR", help="take the password from this variable")

    users = noun("user", "users")
    p = cmd(users, "add", "user_add", "add a user")
    p.add_argument("name", help="the new user's name")
    p.add_argument("--admin", action="store_true", help="may break any parcel's lock through the API")
    password(p)
    p = cmd(users, "remove", "user_remove", "remove a user who owns no parcels")
    p.add_argument("name", help="the user's name")
    p = cmd(users, "password", "user_password", "set a user's password (revokes their tokens)")
    p.add_argument("name", help="the user's name")
    password(p)
    cmd(users, "list", "user_list", "list users")

    parcels = noun("parcel", "parcels")
    p = cmd(parcels, "create", "parcel_create",
            "create a parcel from a disk image (raw, qcow2, vmdk, vdi, vhdx; see doc/parcels.md)")
    p.add_argument("--owner", required=True, help="the user who owns it")
    p.add_argument("--name", required=True, help="its name, unique among the owner's parcels")
    p.add_argument("--disk", required=True, help="the disk image: raw, qcow2, vmdk, vdi or vhdx (read, never copied)")
    p.add_argument("--format", choices=qemuimg.FORMATS, help="the image's format (default: as qemu-img identifies it)")
    p.add_argument("--firmware", choices=FIRMWARES, default="bios",
                   help="what the VM boots with when it has no --kernel: bios (SeaBIOS, the default) or uefi (OVMF)")
    p.add_argument("--force", action="store_true",
                   help="create it even if the disk shows no bootloader for the firmware and no --kernel is given")
    p.add_argument("--ram", type=int, required=True, metavar="MIB", help="VM memory in MiB")
    p.add_argument("--machine", help="QEMU machine type (versioned, e.g. pc-q35-7.2)")
    p.add_argument("--cpu", help="QEMU CPU model")
    p.add_argument("--smp", type=int, help="virtual CPUs")
    p.add_argument("--vm", help="more VM settings as a JSON object or a file holding one")
    p.add_argument("--kernel", help="kernel for direct boot")
    p.add_argument("--initrd", help="initrd for direct boot")
    p.add_argument("--cmdline", help="kernel command line")
    p.add_argument("--chunk-size", type=int, help=f"the disk's chunk size in bytes (default {DEFAULT_CHUNK_SIZE})")
    p.add_argument("--memory-chunk-size", type=int,
                   help="the memory image's chunk size in bytes (default: the disk's)")
    p.add_argument("--scrypt-log2n", type=int, help="scrypt cost of the key envelope (default 15)")
    credentials(p)
    p = cmd(parcels, "list", "parcel_list", "list parcels")
    p.add_argument("--owner", help="only this user's parcels")
    p = cmd(parcels, "show", "parcel_show", "show a parcel, its lock and versions")
    p.add_argument("parcel", help="UUID or owner/name")
    p = cmd(parcels, "copy", "parcel_copy", "copy a parcel's current version into a new parcel")
    p.add_argument("parcel", help="UUID or owner/name")
    p.add_argument("--owner", required=True, help="the user who owns the copy")
    p.add_argument("--name", required=True, help="the copy's name")
    p.add_argument("--scrypt-log2n", type=int, help="scrypt cost of the new key envelope (default 15)")
    credentials(p)
    credentials(p, "new-")
    p = cmd(parcels, "remove", "parcel_remove", "remove a parcel and all its versions")
    p.add_argument("parcel", help="UUID or owner/name")
    p.add_argument("--force", action="store_true", help="even if it is locked")
    p = cmd(parcels, "set", "parcel_set", "change the VM's network, port forwards or rng (makes a new version)")
    p.add_argument("parcel", help="UUID or owner/name")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--forward", action="append", metavar="SPEC",
                       help="forward a host port to the guest, [tcp:|udp:][HOSTADDR:]HOSTPORT-[GUESTADDR:]GUESTPORT "
                            "(host address default 127.0.0.1), e.g. tcp:2222-:22; repeatable; replaces the forwards")
    group.add_argument("--no-forwards", action="store_true", help="remove every port forward")
    p.add_argument("--net", choices=devices.MODELS["net"], help="user-mode network on a virtio NIC, or no NIC")
    p.add_argument("--rng", choices=devices.MODELS["rng"], help="a virtio random number generator, or none")
    credentials(p)

    versions = noun("version", "versions")
    p = cmd(versions, "list", "version_list", "list a parcel's versions")
    p.add_argument("parcel", help="UUID or owner/name")
    p = cmd(versions, "prune", "version_prune", "delete all but the newest N versions")
    p.add_argument("parcel", help="UUID or owner/name")
    p.add_argument("--keep", type=int, required=True, metavar="N", help="how many of the newest versions to keep")
    p = cmd(versions, "rollback", "version_rollback", "make a new version with an older version's content")
    p.add_argument("parcel", help="UUID or owner/name")
    p.add_argument("version", type=int, help="the older version whose content the new version gets")
    p.add_argument("--force", action="store_true", help="break a client's lock to do it")
    credentials(p)

    locks = noun("lock", "locks")
    p = cmd(locks, "show", "lock_show", "show one parcel's lock, or every held lock")
    p.add_argument("parcel", nargs="?", help="UUID or owner/name")
    p = cmd(locks, "break", "lock_break", "break a parcel's lock")
    p.add_argument("parcel", help="UUID or owner/name")
    p.add_argument("--reason", default="", help="recorded in the audit log")

    p = cmd(top, "gc", "gc", "delete chunks that no version references (safe while clients upload)")
    p.add_argument("--grace", type=float, help="keep chunks touched this recently (seconds; default server.gc_grace_seconds)")
    p.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")
    p = cmd(top, "fsck", "fsck", "re-hash every chunk and check every version is complete")
    p.add_argument("--repair", action="store_true", help="delete corrupt objects and forget missing ones")
    cmd(top, "usage", "usage", "bytes stored, dedup ratio, per user")
    p = cmd(top, "fingerprint", "fingerprint",
            "print the server certificate's fingerprint and the `isr login` line to hand a user")
    p.add_argument("--user", help="the user the login line is for (default: a NAME placeholder)")
    p.add_argument("--url", metavar="https://HOST:PORT",
                   help="the address users reach the server at (default: from server.listen and the certificate)")
    p = cmd(top, "audit", "audit", "show the audit log (lock actions, commits, admin actions)")
    p.add_argument("--parcel", help="UUID or owner/name")
    p.add_argument("--limit", type=int, default=100, metavar="N", help="the newest N entries (default 100)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.func is None:
        args.help_of.print_help(sys.stderr)
        return 2
    admin = None
    try:
        config = load_config(args)
        admin = Admin(config, args.json, may_create=args.func == "user_add")
        getattr(admin, args.func)(args)
    except ApiError as e:
        print(f"isr-admin: {e}", file=sys.stderr)
        return 1
    except (ServerError, ParcelError) as e:
        print(f"isr-admin: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("isr-admin: interrupted", file=sys.stderr)
        return 130
    finally:
        if admin is not None:
            admin.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
