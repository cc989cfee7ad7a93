"""The exceptions of the parcels package.

Every public function in `parcels` raises only `ParcelError` subclasses, so a caller can catch one root.
Which subclass tells the caller what to do next: a `FormatError` will not go away by retrying, an
`IntegrityError` means some stored byte is not what was written (fetch it again from elsewhere), a
`WrongKeyError` asks the user for another passphrase or key file, and a `StoreError` is about the place
where things are kept (a missing file, a full disk).
"""
from __future__ import annotations


class ParcelError(Exception):
    """Root of every error raised by the parcels package."""


class FormatError(ParcelError):
    """Bytes or fields that do not follow doc/parcel-format.md, or an argument outside its allowed range."""


class IntegrityError(ParcelError):
    """A digest, tag or authentication check failed: a byte changed after it was written, or the store
    returned another object than the one asked for."""


class WrongKeyError(ParcelError):
    """A key envelope cannot be opened: wrong passphrase or key file, or a damaged envelope (the format
    cannot tell these apart, so neither can this error)."""


class StoreError(ParcelError):
    """A parcel store or keyring database cannot be read or written."""


class NotFoundError(StoreError):
    """The store has no such parcel, version, blob or chunk object."""


class ImageError(ParcelError):
    """An input or output image file cannot be read, written or converted."""


class MissingFilesError(ParcelError):
    """A blob is compressed against files (doc/parcel-format.md, "Sealed blobs": compression 2) this reader
    does not have, or has other versions of: read the blob it stands in for instead. ``missing``: their names."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
