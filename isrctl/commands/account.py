"""`isr login`, `isr logout`, `isr passwd`: this site's account on the server and a parcel's credential."""
from __future__ import annotations

import argparse
import base64
import getpass
import hashlib
import socket
import sys
import uuid
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from parcels.envelope import new_keyfile, wrap_envelope
from parcels.secretsource import read_secret

from .. import config as configmod
from .. import paths
from ..checkout import Client, holding_lock
from ..errors import CredentialError, IsrError
from ..remote import Remote, RemoteError, fetch_certificate, normalize_fingerprint
from . import common


def spki_pin(der: bytes) -> str:
    """The public-key pin (``sha256//<base64>``) of a DER certificate, as libcurl (vulpes ``--pin``) takes it."""
    cert = x509.load_der_x509_certificate(der)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256//" + base64.b64encode(hashlib.sha256(spki).digest()).decode()


def cmd_login(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    fingerprint = "sha256:" + normalize_fingerprint(args.fingerprint)
    der = fetch_certificate(url)
    seen = "sha256:" + hashlib.sha256(der).hexdigest()
    if seen != fingerprint:
        raise IsrError(f"{url} presents the certificate {seen}, not the {fingerprint} you gave: not logging in "
                       f"(check the fingerprint isr-server printed)")
    password = read_secret(file=args.password_file, env=args.password_env, option="--password")
    if password is None:
        if not sys.stdin.isatty():
            raise CredentialError("no password: run from a terminal or give --password-file FILE|- or "
                                  "--password-env VAR")
        password = getpass.getpass(f"password of {args.user} on {url}: ")
    site = args.site or configmod.default_site()
    with Remote(url, fingerprint=fingerprint) as remote:
        token = remote.login(args.user, password, label=f"isr on {socket.gethostname()} ({site})"[:100])
    cfg = configmod.ClientConfig(server=url, user=args.user, fingerprint=fingerprint, pin=spki_pin(der), site=site,
                                 accel=args.accel, cache_limit=args.cache_limit or "")
    configmod.write_token(token)
    path = configmod.save(cfg)
    print(f"logged in to {url} as {args.user} (site {site}); settings in {path}")
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    try:
        with Client() as client:
            client.remote.logout()
    except RemoteError as exc:
        print(f"isr: the server did not revoke the token ({exc}); forgetting it anyway", file=sys.stderr)
    paths.token_file().unlink(missing_ok=True)
    print("logged out")
    return 0


def cmd_passwd(args: argparse.Namespace) -> int:
    with Client() as client:
        parcel, state = common.server_state(client, args.parcel)
        parcel_keys = client.unlock(parcel["id"], common.parcel_credential(args, parcel["name"]))
        keyfile: bytes | None = None
        passphrase: str | None = None
        if args.new_key_file:
            if args.new_passphrase_file or args.new_passphrase_env:
                raise CredentialError("give either a new passphrase or --new-key-file, not both")
            new_key = Path(args.new_key_file)
            if new_key.exists():
                raise IsrError(f"{new_key} exists: give a new file name for the new key file")
            keyfile = new_keyfile()
        else:
            passphrase = read_secret(file=args.new_passphrase_file, env=args.new_passphrase_env,
                                     option="--new-passphrase")
        if keyfile is None and passphrase is None:
            if not sys.stdin.isatty():
                raise CredentialError("no new passphrase: give --new-passphrase-file FILE|-, --new-passphrase-env "
                                      "VAR or --new-key-file FILE")
            passphrase = getpass.getpass("new passphrase: ")
            if not passphrase or passphrase != getpass.getpass("again: "):
                raise CredentialError("the two passphrases differ (or are empty); nothing changed")
        envelope = wrap_envelope(uuid.UUID(parcel["id"]), parcel_keys.parcel_key, parcel_keys.convergence_secret,
                                 passphrase=passphrase, keyfile=keyfile)
        with state.locked(), holding_lock(client, state, parcel) as (lock, _, _):
            if keyfile is not None:
                configmod.write_private(Path(args.new_key_file), keyfile)
            client.remote.put_key_envelope(parcel["id"], envelope, lock.nonce)
            state.save_envelope(envelope)
    print(f"changed the {'key file' if keyfile else 'passphrase'} of {parcel['name']}"
          + (f"; the new key file is {args.new_key_file}" if keyfile else ""))
    return 0
