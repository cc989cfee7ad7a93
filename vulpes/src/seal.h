/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SEAL_HEADER_LEN 48
#define SEAL_OVERHEAD 64            /* header and GCM tag */
#define SEAL_PARCEL_KEY_LEN 32

/*
 * The largest payload this implementation seals or opens, 1 GiB (the format allows 64-bit lengths and
 * lets an implementation state its limit): the payload and its compressed form are held in memory at
 * once.  The same limit as parcels/seal.py, so that neither side writes what the other refuses.
 */
#define SEAL_PAYLOAD_MAX ((uint64_t) 1 << 30)

typedef enum SealKind {
        SEAL_KIND_MANIFEST = 1,
        SEAL_KIND_KEYRING = 2,
        SEAL_KIND_DEVICE_STATE = 3,
        SEAL_KIND_BOOT_FILE = 4,
} SealKind;

/*
 * Seals len bytes of payload under the parcel key with a fresh random salt, compressing at zstd level
 * `level` unless that is not smaller, or not at all if level is 0.  The blob is malloc()ed.
 */
int seal_blob(const uint8_t parcel_key[SEAL_PARCEL_KEY_LEN], SealKind kind, const void *payload, size_t len,
              int level, uint8_t **ret_blob, size_t *ret_blob_len);

/*
 * Opens a sealed blob of the expected kind whose payload is at most max_length bytes.  Returns -EBADMSG
 * for a damaged or foreign blob, another kind, an oversized payload, a failed GCM check or a wrong
 * decompressed length.  The payload is malloc()ed (with one extra NUL byte after it, for text payloads).
 */
int seal_open(const uint8_t parcel_key[SEAL_PARCEL_KEY_LEN], const void *blob, size_t blob_len, SealKind kind,
              uint64_t max_length, uint8_t **ret_payload, size_t *ret_len);
