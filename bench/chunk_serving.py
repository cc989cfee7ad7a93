#!/usr/bin/env python3
"""Chunk GET throughput of isr-server's serving paths next to nginx serving the same files, in one run.

    .venv/bin/python bench/chunk_serving.py [--chunks 2000] [--requests 30000] [--connections 4]
                                            [--streams 32] [--trials 3] [--s3]
                                            [--tree LABEL=DIR ...] [--paths sendfile,stream] [--section TITLE]

Makes `--chunks` random 128 KiB chunk objects in a directory store, then for each serving path starts a
server on a free loopback port, and drives it with h2load (nghttp2-client) over TLS and HTTP/2 with
`--connections` x `--streams` concurrent streams, every request for a different chunk in turn:

- ``sendfile``: isr-server, directory store, chunk files handed to granian (ASGI pathsend): zero-copy.
- ``stream``: isr-server, directory store, chunk bytes read and sent through Python.
- ``s3-stream`` (with --s3): isr-server, chunks in versitygw (S3), proxied through Python.
- ``nginx``: nginx-light serving the same files with the same certificate (the reference).

Each path is measured `--trials` times; the table shows the median and the ratio to nginx. All traffic
stays on 127.0.0.1 and every run is bounded by its request count.

``--tree LABEL=DIR`` (repeatable) runs isr-server from other source trees in the same run, e.g. a git
worktree of an older commit, each with its Python code on PYTHONPATH: before/after comparisons on one
machine in one run. The targets take turns in every trial, starting one further along each time, so drift
in the machine's load falls on all of them alike. ``--section TITLE`` writes the table, the machine, the
date and the command into that section of BENCHMARKS.md.

``--python`` also times the Python of one chunk GET inside each tree's ASGI app, without network or TLS
(a cached token, the sendfile path, minimum over rounds of 5000): the part of the cost the server's code
decides, which the end-to-end figures (mostly TLS, HTTP/2 and the load generator on the same cores) hide
in their noise.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vulpes_common import REPO, machine, table, today, update_section  # also puts the repository on sys.path

from isrctl.remote import Remote  # noqa: E402

BIN = Path(sys.executable).parent
CHUNK_SIZE = 131072


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"chunk_serving: {what} did not start")
            time.sleep(0.05)


def make_chunks(root: Path, count: int) -> list[str]:
    tags = []
    for _ in range(count):
        data = os.urandom(CHUNK_SIZE)
        tag = hashlib.sha256(data).hexdigest()
        path = root / "chunks" / tag[:2] / tag[2:4] / tag
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        tags.append(tag)
    return tags


def h2load(base: str, uris: Path, requests: int, connections: int, streams: int, token: str | None) -> dict:
    cmd = ["h2load", "-n", str(requests), "-c", str(connections), "-m", str(streams), "-t", "1",
           "-B", base, "-i", str(uris)]
    if token:
        cmd += ["-H", f"authorization: Bearer {token}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    finished = re.search(r"finished in ([\d.]+)m?s, ([\d.]+) req/s, ([\d.]+)([KMG]?B)/s", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if not finished or not codes:
        raise SystemExit(f"chunk_serving: cannot parse h2load output:\n{out}")
    if int(codes.group(1)) != requests:
        raise SystemExit(f"chunk_serving: not every request succeeded:\n{out}")
    scale = {"B": 1e-6, "KB": 1e-3, "MB": 1.0, "GB": 1e3}[finished.group(4)]
    protocol = re.search(r"Application protocol: (\S+)", out)
    return {"req_s": float(finished.group(2)), "mb_s": float(finished.group(3)) * scale,
            "protocol": protocol.group(1) if protocol else "?"}


def curl_parallel(base: str, tags: list[str], requests: int, parallel: int, token: str | None,
                  cacert: Path, work: Path) -> dict:
    """Fetch ``requests`` chunks with one curl process (libcurl multi, HTTP/2, ``parallel`` transfers at once),
    following redirects: the client side of the presigned-URL path, which h2load cannot follow."""
    config = work / f"curl-{abs(hash(base))}.cfg"
    config.write_text("".join(f'url = "{base}/v1/chunks/{tags[i % len(tags)]}"\noutput = "/dev/null"\n'
                              for i in range(requests)))
    # The server's self-signed certificate is no CA, so verify it the way vulpes does: by its pinned key.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    spki = x509.load_pem_x509_certificate(cacert.read_bytes()).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    pin = "sha256//" + base64.b64encode(hashlib.sha256(spki).digest()).decode()
    cmd = ["curl", "--silent", "--show-error", "--parallel", "--parallel-immediate", "--parallel-max", str(parallel),
           "--http2", "--location", "--insecure", "--pinnedpubkey", pin, "--write-out", "%{http_code}\n",
           "--config", str(config)]
    if token:
        cmd += ["--header", f"Authorization: Bearer {token}"]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    codes = proc.stdout.split()
    if proc.returncode != 0 or len(codes) != requests or set(codes) != {"200"}:
        raise SystemExit(f"chunk_serving: curl did not fetch every chunk (exit {proc.returncode}, "
                         f"codes {sorted(set(codes))}): {proc.stderr.strip()[:500]}")
    return {"req_s": requests / seconds, "mb_s": requests * (CHUNK_SIZE + 28) / seconds / 1e6,
            "protocol": "h2 (curl)"}


class IsrServer:
    """isr-server on a free port with one serving mode; a user 'bench' and its token. With `tree`, the
    server's Python code comes from that source tree (PYTHONPATH)."""

    def __init__(self, work: Path, store: dict, serving: str, workers: int, tree: Path | None = None) -> None:
        self.serving = serving
        self.dir = work / f"isr-{serving}-{store['store.backend']}-{abs(hash(str(tree)))}"
        self.dir.mkdir()
        env = dict(os.environ, PYTHONPATH=str(tree)) if tree is not None else None
        settings = {"server.listen": "127.0.0.1:0", "server.workers": workers, "server.data_dir": str(self.dir),
                    "server.chunk_serving": serving, "server.token_cache_seconds": 5, **store}
        config = self.dir / "isr-server.toml"
        sections: dict[str, list[str]] = {}
        for key, value in settings.items():
            section, _, name = key.partition(".")
            sections.setdefault(section, []).append(f"{name} = {json.dumps(value)}")
        config.write_text("".join(f"[{s}]\n" + "\n".join(v) + "\n" for s, v in sections.items()))
        subprocess.run([str(BIN / "isr-admin"), "-c", str(config), "user", "add", "bench", "--password-file", "-"],
                       input="bench-password\n", text=True, check=True, capture_output=True, timeout=60, env=env)
        self.proc = subprocess.Popen([str(BIN / "isr-server"), "-c", str(config)], stdout=subprocess.PIPE,
                                     stderr=open(self.dir / "server.log", "w"), text=True, start_new_session=True,
                                     env=env)
        url = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "listening on" in line:
                url = line.split("listening on ", 1)[1].strip()
            if "certificate fingerprint" in line:
                self.fingerprint = line.split("fingerprint ", 1)[1].strip()
                break
        if not url:
            raise SystemExit(f"chunk_serving: isr-server did not start:\n{(self.dir / 'server.log').read_text()}")
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])
        wait_port(self.port, self.proc, "isr-server")
        deadline = time.monotonic() + 30
        while True:
            try:
                with Remote(url, fingerprint=self.fingerprint) as client:
                    self.token = client.login("bench", "bench-password")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.cert = self.dir / "tls" / "server.crt"
        self.key = self.dir / "tls" / "server.key"

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=20)


class Nginx:
    """nginx serving ROOT/chunks/ab/cd/<tag> as /v1/chunks/<tag> over TLS + HTTP/2."""

    def __init__(self, work: Path, root: Path, cert: Path, key: Path, workers: int) -> None:
        self.dir = work / "nginx"
        (self.dir / "logs").mkdir(parents=True)
        self.port = free_port()
        conf = self.dir / "nginx.conf"
        conf.write_text(f"""
user root;
worker_processes {workers};
daemon off;
pid {self.dir}/nginx.pid;
error_log {self.dir}/logs/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    http2_max_requests 1000000;
    server {{
        listen 127.0.0.1:{self.port} ssl http2;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        location ~ "^/v1/chunks/([0-9a-f]{{2}})([0-9a-f]{{2}})([0-9a-f]{{60}})$" {{
            alias {root}/chunks/$1/$2/$1$2$3;
        }}
    }}
}}
""")
        self.proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(self.dir)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "nginx.stderr", "w"), start_new_session=True)
        wait_port(self.port, self.proc, "nginx")
        self.url = f"https://127.0.0.1:{self.port}"

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=20)


class Process:
    """A process started here that `stop()` ends, as IsrServer and Nginx are."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


def start_versitygw(work: Path) -> tuple[subprocess.Popen[bytes], dict]:
    binary = shutil.which("versitygw") or "/usr/local/bin/versitygw"
    data = work / "s3"
    data.mkdir()
    port = free_port()
    proc = subprocess.Popen([binary, "--access", "benchaccess", "--secret", "benchsecret0123", "--port",
                             f"127.0.0.1:{port}", "--quiet", "posix", str(data)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(port, proc, "versitygw")
    settings = {"store.backend": "s3", "store.endpoint": f"http://127.0.0.1:{port}", "store.bucket": "bench",
                "store.access_key": "benchaccess", "store.secret_key": "benchsecret0123"}
    return proc, settings


def upload_to_s3(settings: dict, root: Path, tags: list[str]) -> None:
    import boto3
    import botocore.config

    client = boto3.client("s3", endpoint_url=settings["store.endpoint"], aws_access_key_id=settings["store.access_key"],
                          aws_secret_access_key=settings["store.secret_key"], region_name="us-east-1",
                          config=botocore.config.Config(s3={"addressing_style": "path"}))
    client.create_bucket(Bucket="bench")
    for tag in tags:
        client.put_object(Bucket="bench", Key=f"chunks/{tag[:2]}/{tag[2:4]}/{tag}",
                          Body=(root / "chunks" / tag[:2] / tag[2:4] / tag).read_bytes())


def handler_time(tree: str, rounds: int = 15, calls: int = 5000) -> float:
    """Microseconds of Python per chunk GET in the ASGI app of the isr-server in `tree` (the minimum
    over `rounds` of `calls` calls): a sqlite + directory server with one chunk and a cached token."""
    sys.path.insert(0, tree)
    import asyncio

    from server import auth
    from server.app import IsrApp
    from server.config import build
    from server.meta import open_meta
    from starlette.types import Message

    root = Path(tempfile.mkdtemp(prefix="isr-bench-"))
    try:
        config = build({"server.data_dir": str(root), "server.token_cache_seconds": 5})
        meta = open_meta(config)
        user = meta.add_user("bench", auth.hash_password("bench", log2n=4))
        token = auth.new_token()
        meta.add_token("0123456789abcdef", auth.secret_hash(token), user.id, "", 3600)
        meta.close()
        tag = make_chunks(root / "store", 1)[0]
        app = IsrApp(config)
        scope = {"type": "http", "http_version": "2", "method": "GET", "path": f"/v1/chunks/{tag}",
                 "raw_path": f"/v1/chunks/{tag}".encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {token}".encode()),
                             (b"user-agent", b"h2load"), (b"accept", b"*/*")],
                 "client": ("127.0.0.1", 40000), "extensions": {"http.response.pathsend": {}}}

        async def measure() -> float:
            started: list[Message] = []
            startup: asyncio.Queue[dict] = asyncio.Queue()
            await startup.put({"type": "lifespan.startup"})

            async def lifespan_send(message: Message) -> None:
                started.append(message)

            lifespan = asyncio.ensure_future(app({"type": "lifespan"}, startup.get, lifespan_send))
            while not started:
                await asyncio.sleep(0.01)
            sent: list[Message] = []

            async def receive() -> dict:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message: Message) -> None:
                sent.append(message)

            await app(dict(scope), receive, send)
            if sent[0].get("status") != 200:
                raise SystemExit(f"chunk_serving: the in-process chunk GET failed: {sent}")
            best = float("inf")
            for _ in range(rounds):
                begin = time.perf_counter()
                for _ in range(calls):
                    await app(dict(scope), receive, send)
                    sent.clear()
                best = min(best, (time.perf_counter() - begin) / calls * 1e6)
            await startup.put({"type": "lifespan.shutdown"})
            await lifespan
            return best

        return asyncio.run(measure())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=30000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams per connection")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="worker processes of isr-server and nginx")
    parser.add_argument("--s3", action="store_true", help="also measure chunks in versitygw proxied by isr-server")
    parser.add_argument("--redirect", action="store_true",
                        help="with --s3: also measure the presigned-redirect path, with curl (which follows "
                             "redirects) against isr-server and nginx alike")
    parser.add_argument("--curl-parallel", type=int, default=64, help="concurrent transfers of the curl client")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                        help="also run isr-server from this source tree (repeatable), labelled LABEL")
    parser.add_argument("--paths", default="sendfile,stream", help="isr-server's serving modes to measure")
    parser.add_argument("--section", help="write the results into this section of BENCHMARKS.md")
    parser.add_argument("--python", action="store_true",
                        help="also time the Python of one chunk GET inside each tree's app (no network)")
    parser.add_argument("--handler-time", metavar="TREE", help=argparse.SUPPRESS)  # the child of --python
    args = parser.parse_args()
    if args.handler_time:
        print(f"{handler_time(args.handler_time):.2f}")
        return 0
    trees: list[tuple[str, Path | None]] = [("", None)]
    if args.tree:
        trees = []
        for item in args.tree:
            label, sep, directory = item.partition("=")
            if not sep or not (Path(directory) / "server" / "__init__.py").is_file():
                raise SystemExit(f"chunk_serving: --tree {item}: want LABEL=DIR with DIR a source tree of this project")
            trees.append((label, Path(directory).resolve()))
    for tool in ("h2load", "nginx"):
        if not shutil.which(tool):
            raise SystemExit(f"chunk_serving: {tool} is not installed (deps/debian.txt: nghttp2-client, nginx-light)")
    work = Path(tempfile.mkdtemp(prefix="isr-bench-"))
    started: list = []
    try:
        store_root = work / "store"
        tags = make_chunks(store_root, args.chunks)
        uris = work / "uris.txt"
        uris.write_text("".join(f"/v1/chunks/{t}\n" for t in tags))
        directory = {"store.backend": "directory", "store.path": str(store_root)}
        targets: list[tuple[str, IsrServer | Nginx]] = []
        for serving in args.paths.split(","):
            for label, tree in trees:
                server = IsrServer(work, directory, serving, args.workers, tree)
                started.append(server)
                targets.append((f"isr-server {serving}" + (f" [{label}]" if label else ""), server))
        if args.s3:
            gw, s3 = start_versitygw(work)
            started.append(Process(gw))
            upload_to_s3(s3, store_root, tags)
            server = IsrServer(work, s3, "stream", args.workers)
            started.append(server)
            targets.append(("isr-server s3-stream", server))
            if args.redirect:
                redirect = IsrServer(work, s3, "redirect", args.workers)
                started.append(redirect)
        first = started[0]
        nginx = Nginx(work, store_root, first.cert, first.key, args.workers)
        started.append(nginx)
        targets.append(("nginx", nginx))
        results: dict[str, list[dict]] = {name: [] for name, _ in targets}
        for trial in range(args.trials):
            # Interleaved, each trial starting one target further, so drift in the machine hits every path alike.
            shift = trial % len(targets)
            for name, target in targets[shift:] + targets[:shift]:
                token = getattr(target, "token", None)
                results[name].append(h2load(target.url, uris, args.requests, args.connections, args.streams, token))
        curl_results: dict[str, list[dict]] = {}
        if args.s3 and args.redirect:
            curl_targets = [("isr-server s3-redirect (curl)", redirect), ("isr-server sendfile (curl)", targets[0][1]),
                            ("nginx (curl)", nginx)]
            curl_results = {name: [] for name, _ in curl_targets}
            for trial in range(args.trials):
                for name, target in curl_targets:
                    curl_results[name].append(curl_parallel(target.url, tags, args.requests, args.curl_parallel,
                                                            getattr(target, "token", None),
                                                            getattr(target, "cert", first.cert), work))
        nginx_rps = statistics.median(r["req_s"] for r in results["nginx"])
        rows = []
        for name, runs in results.items():
            rps = statistics.median(r["req_s"] for r in runs)
            mbs = statistics.median(r["mb_s"] for r in runs)
            rows.append({"path": name, "req_s": round(rps), "mb_s": round(mbs, 1), "vs_nginx": round(rps / nginx_rps, 2),
                         "protocol": runs[0]["protocol"], "trials": [round(r["req_s"]) for r in runs]})
            # With trees: each trial against the first tree's same path in the same trial (they ran back to back).
            first = name.split(" [")[0] + f" [{trees[0][0]}]"
            if trees[0][0] and first in results:
                ratios = [r["req_s"] / b["req_s"] for r, b in zip(runs, results[first])]
                rows[-1]["vs_first"] = round(statistics.median(ratios), 2)
        if curl_results:
            curl_nginx = statistics.median(r["req_s"] for r in curl_results["nginx (curl)"])
            for name, runs in curl_results.items():
                rps = statistics.median(r["req_s"] for r in runs)
                rows.append({"path": name, "req_s": round(rps),
                             "mb_s": round(statistics.median(r["mb_s"] for r in runs), 1),
                             "vs_nginx": round(rps / curl_nginx, 2), "protocol": runs[0]["protocol"],
                             "trials": [round(r["req_s"]) for r in runs]})
        python_rows = []
        if args.python:
            for label, tree in trees:  # each in a process of its own, with that tree's code
                times = [float(subprocess.run([sys.executable, __file__, "--handler-time", str(tree or REPO)],
                                              capture_output=True, text=True, check=True, timeout=600).stdout)
                         for _ in range(args.trials)]
                python_rows.append(["isr-server sendfile" + (f" [{label}]" if label else ""),
                                    f"{min(times):.1f}", ", ".join(f"{t:.1f}" for t in times)])
        header = (f"chunk GET, {CHUNK_SIZE // 1024} KiB objects, TLS + HTTP/2, {args.connections} connections x "
                  f"{args.streams} streams, {args.requests} requests per trial, median of {args.trials}, "
                  f"{args.workers} server workers, {os.cpu_count()} cores, {platform.node()}, "
                  f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z")
        print(header)
        base = f"vs [{trees[0][0]}]" if trees[0][0] else ""
        print(f"{'path':<32} {'req/s':>8} {'MB/s':>8} {'vs nginx':>9} {base:>11}  trials (req/s)")
        for row in rows:
            print(f"{row['path']:<32} {row['req_s']:>8} {row['mb_s']:>8} {row['vs_nginx']:>9} "
                  f"{row.get('vs_first', ''):>11}  {row['trials']}")
        python_table = ""
        if python_rows:
            python_table = table(["path", "µs of Python per chunk GET (best)", "each process's best"], python_rows)
            print(python_table)
        if args.json:
            Path(args.json).write_text(json.dumps({"setup": header, "results": rows, "python": python_rows}, indent=2))
        if args.section:
            command = shlex.join(["bench/chunk_serving.py", *sys.argv[1:]])
            columns = ["path", "req/s (median)", "MB/s", "vs nginx"] + ([f"{base} (median of per-trial ratios)"]
                                                                       if base else []) + ["trials (req/s)"]
            body = (f"Machine: {machine()}. Date: {today()}. Command: `.venv/bin/python {command}`.\n\n{header}.\n\n"
                    + table(columns, [[r["path"], str(r["req_s"]), str(r["mb_s"]), f"{r['vs_nginx']:.2f}"]
                                     + ([f"{r['vs_first']:.2f}" if "vs_first" in r else ""] if base else [])
                                     + [", ".join(map(str, r["trials"]))] for r in rows]))
            if python_table:
                body += ("\n\nPython per chunk GET inside the app (`--python`: no network, no TLS, cached token, "
                         f"sendfile path; the best round of 5000 calls in each of {args.trials} processes):\n\n"
                         + python_table)
            update_section(args.section, body)
    finally:
        for item in reversed(started):
            try:
                item.stop()
            except Exception:
                pass
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
