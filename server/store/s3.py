"""The S3 object store: objects in one bucket of any S3-compatible server (path-style addressing).

Only this module knows boto3. A chunk GET is answered either by streaming the object through the server
or, with ``chunk_serving = redirect``, by a redirect to a presigned URL so the bytes never pass through
Python at all.
"""
from __future__ import annotations

import tempfile
from collections.abc import Iterator

import boto3
import botocore.config
import botocore.exceptions

from ..config import Config
from ..errors import NotFound, StorageError
from .base import ObjectInfo, ObjectStore, Upload

_SPOOL_BYTES = 16 * 1024 * 1024


class S3Store(ObjectStore):
    """Objects under ``prefix`` in one bucket."""

    kind = "s3"

    def __init__(self, config: Config) -> None:
        self.bucket = config["store.bucket"]
        self.endpoint = config["store.endpoint"]
        self.prefix = config["store.prefix"]
        self.access_key = config["store.access_key"]
        session = boto3.session.Session()
        options = botocore.config.Config(
            region_name=config["store.region"],
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=32,
            connect_timeout=10,
            read_timeout=60,
            # Plain Content-MD5/SHA-256 payload signing works with every S3-compatible server;
            # the newer trailing-checksum uploads do not.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        kwargs = {}
        if config["store.access_key"]:
            kwargs = {"aws_access_key_id": config["store.access_key"],
                      "aws_secret_access_key": config["store.secret_key"]}
        verify: bool | str = config["store.ca_bundle"] or True
        try:
            self.client = session.client("s3", endpoint_url=config["store.endpoint"], config=options,
                                         verify=verify, **kwargs)
        except (botocore.exceptions.BotoCoreError, ValueError) as e:
            raise StorageError(f"cannot set up the S3 client for {config['store.endpoint']}: {e}") from None

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _fail(self, what: str, error: Exception, *, bucket_request: bool = False) -> StorageError:
        """The one-line StorageError for a failed request; ``bucket_request``: a 404 means the bucket is
        missing (HEAD of the bucket has no body to say NoSuchBucket)."""
        if isinstance(error, botocore.exceptions.ClientError):
            code = error.response.get("Error", {}).get("Code", "?")
            message = error.response.get("Error", {}).get("Message", "")
            if code == "NoSuchBucket" or (bucket_request and code in ("404", "NotFound")):
                return StorageError(f"S3 {what} failed: there is no bucket {self.bucket} at {self.endpoint}: create "
                                    f"it (e.g. `aws s3 mb s3://{self.bucket} --endpoint-url {self.endpoint}`) or "
                                    f"set store.bucket to an existing one")
            if bucket_request and code in ("403", "Forbidden", "AccessDenied", "InvalidAccessKeyId",
                                           "SignatureDoesNotMatch"):
                return StorageError(f"S3 {what} failed: {code} {message}".rstrip() + f": the key "
                                    f"{self.access_key or '(from the AWS environment)'} may not use bucket {self.bucket} "
                                    f"at {self.endpoint}: check store.access_key, store.secret_key and the key's policy")
            return StorageError(f"S3 {what} failed: {code} {message}".rstrip())
        return StorageError(f"S3 {what} failed: {error}")

    def check(self) -> None:
        """Check that the bucket is reachable with the configured credentials."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(f"access to bucket {self.bucket}", e, bucket_request=True) from None

    def presigned_url(self, key: str, seconds: int) -> str | None:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=seconds)

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(f"PUT {key}", e) from None

    def new_upload(self) -> Upload:
        return _SpooledUpload(self)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(f"no object {key}") from None
            raise self._fail(f"GET {key}", e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"GET {key}", e) from None

    def size(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail(f"HEAD {key}", e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"HEAD {key}", e) from None

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(f"DELETE {key}", e) from None

    def delete_prefix(self, prefix: str) -> int:
        keys = [info.key for info in self.list(prefix)]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
            try:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                raise self._fail(f"DELETE under {prefix}", e) from None
        return len(keys)

    def copy(self, src: str, dst: str) -> None:
        try:
            self.client.copy_object(Bucket=self.bucket, Key=self._key(dst),
                                    CopySource={"Bucket": self.bucket, "Key": self._key(src)})
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(f"no object {src}") from None
            raise self._fail(f"COPY {src}", e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"COPY {src}", e) from None

    def move_prefix(self, src: str, dst: str) -> None:
        # S3 has no rename: empty the target, copy, then delete the sources. The metadata database, not
        # the store, decides whether a version exists, so a half-done move is never visible to clients.
        self.delete_prefix(dst)
        moved = []
        for info in self.list(src):
            self.copy(info.key, dst + info.key[len(src):])
            moved.append(info.key)
        for key in moved:
            self.delete(key)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][len(self.prefix):], int(item["Size"]),
                                     item["LastModified"].timestamp())
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(f"LIST {prefix}", e) from None

    def close(self) -> None:
        self.client.close()


class _SpooledUpload(Upload):
    """Buffers in memory up to 16 MiB, then in a temporary file; uploads on commit."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.size = 0
        self.file = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)

    def commit(self, key: str) -> None:
        self.file.seek(0)
        try:
            self.store.client.upload_fileobj(self.file, self.store.bucket, self.store._key(key))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self.store._fail(f"PUT {key}", e) from None
        finally:
            self.file.close()

    def abort(self) -> None:
        self.file.close()
