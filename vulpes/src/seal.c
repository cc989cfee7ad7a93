/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Sealed blobs: manifests, keyring streams, device state and boot files, compressed and encrypted under
 * a key derived from the parcel key and a fresh salt (doc/parcel-format.md, "Sealed blobs").
 *
 * Threading: pure functions, safe from any thread.
 */
#include "seal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "compress.h"
#include "crypto.h"
#include "log.h"

static const uint8_t seal_magic[4] = { 'I', 'S', 'R', 'B' };
static const char blob_key_label[] = "isr-blob-v1";

enum {
        SEAL_FORMAT_VERSION = 1,
        SEAL_SALT_OFFSET = 8,
        SEAL_SALT_LEN = 32,
        SEAL_LENGTH_OFFSET = 40,
        SEAL_COMPRESSION_NONE = 0,
        SEAL_COMPRESSION_ZSTD = 1,
};

static int blob_key_derive(const uint8_t parcel_key[SEAL_PARCEL_KEY_LEN], const uint8_t *salt,
                           uint8_t ret_key[CRYPTO_KEY_LEN]) {
        const CryptoBuffer parts[] = {
                { blob_key_label, sizeof(blob_key_label) - 1 },
                { salt, SEAL_SALT_LEN },
        };

        return crypto_hmac_sha256(parcel_key, SEAL_PARCEL_KEY_LEN, parts, 2, ret_key);
}

static bool kind_valid(unsigned kind) {
        return kind >= SEAL_KIND_MANIFEST && kind <= SEAL_KIND_BOOT_FILE;
}

int seal_blob(const uint8_t parcel_key[SEAL_PARCEL_KEY_LEN], SealKind kind, const void *payload, size_t len,
              int level, uint8_t **ret_blob, size_t *ret_blob_len) {
        uint8_t key[CRYPTO_KEY_LEN], *blob, *zbuf = NULL;
        const void *data = payload;
        size_t data_len = len, zlen = 0, zcap = 0;
        unsigned compression = SEAL_COMPRESSION_NONE;
        int r;

        if (!kind_valid(kind) || (uint64_t) len > SEAL_PAYLOAD_MAX)
                return -EINVAL;

        if (level != 0) {
                zcap = compress_bound(len);
                zbuf = malloc(zcap);
                if (!zbuf)
                        return -ENOMEM;
                r = compress_frame(payload, len, level, zbuf, zcap, &zlen);
                if (r < 0)
                        goto out_zbuf;
                if (zlen < len) {
                        data = zbuf;
                        data_len = zlen;
                        compression = SEAL_COMPRESSION_ZSTD;
                }
        }

        blob = malloc(data_len + SEAL_OVERHEAD);
        if (!blob) {
                r = -ENOMEM;
                goto out_zbuf;
        }
        memcpy(blob, seal_magic, sizeof(seal_magic));
        blob[4] = SEAL_FORMAT_VERSION;
        blob[5] = (uint8_t) kind;
        blob[6] = (uint8_t) compression;
        blob[7] = 0;
        r = crypto_random_bytes(blob + SEAL_SALT_OFFSET, SEAL_SALT_LEN);
        if (r < 0)
                goto out_blob;
        for (int i = 0; i < 8; i++)
                blob[SEAL_LENGTH_OFFSET + i] = (uint8_t) ((uint64_t) len >> (56 - 8 * i));

        r = blob_key_derive(parcel_key, blob + SEAL_SALT_OFFSET, key);
        if (r < 0)
                goto out_blob;
        r = crypto_aes256gcm_encrypt(key, blob, SEAL_HEADER_LEN, data, data_len, blob + SEAL_HEADER_LEN,
                                     blob + SEAL_HEADER_LEN + data_len);
        crypto_wipe(key, sizeof(key));
        if (r < 0)
                goto out_blob;

        *ret_blob = blob;
        *ret_blob_len = data_len + SEAL_OVERHEAD;
        blob = NULL;
out_blob:
        free(blob);
out_zbuf:
        crypto_wipe(zbuf, zlen);
        free(zbuf);
        return r;
}

int seal_open(const uint8_t parcel_key[SEAL_PARCEL_KEY_LEN], const void *blob, size_t blob_len, SealKind kind,
              uint64_t max_length, uint8_t **ret_payload, size_t *ret_len) {
        const uint8_t *b = blob;
        uint8_t key[CRYPTO_KEY_LEN], *data = NULL, *payload = NULL;
        uint64_t payload_len = 0;
        size_t data_len;
        int r;

        if (blob_len < SEAL_OVERHEAD) {
                log_debug("failed to open sealed blob: %zu bytes is shorter than header and tag", blob_len);
                return -EBADMSG;
        }
        if (memcmp(b, seal_magic, sizeof(seal_magic)) != 0 || b[4] != SEAL_FORMAT_VERSION ||
            b[6] > SEAL_COMPRESSION_ZSTD || b[7] != 0) {
                log_debug("failed to open sealed blob: bad magic, version, compression or reserved byte");
                return -EBADMSG;
        }
        if (!kind_valid(kind) || b[5] != kind) {
                log_debug("failed to open sealed blob: kind %u, expected %u", b[5], (unsigned) kind);
                return -EBADMSG;
        }
        for (int i = 0; i < 8; i++)
                payload_len = payload_len << 8 | b[SEAL_LENGTH_OFFSET + i];
        if (payload_len > max_length || payload_len > SEAL_PAYLOAD_MAX) {
                log_debug("failed to open sealed blob: payload of %llu bytes is above the limit of %llu",
                          (unsigned long long) payload_len, (unsigned long long) max_length);
                return -EBADMSG;
        }
        data_len = blob_len - SEAL_OVERHEAD;
        if (b[6] == SEAL_COMPRESSION_NONE && data_len != payload_len) {
                log_debug("failed to open sealed blob: uncompressed payload of %zu bytes, header says %llu",
                          data_len, (unsigned long long) payload_len);
                return -EBADMSG;
        }

        r = blob_key_derive(parcel_key, b + SEAL_SALT_OFFSET, key);
        if (r < 0)
                return r;

        payload = malloc((size_t) payload_len + 1);
        if (!payload) {
                r = -ENOMEM;
                goto out_key;
        }
        if (b[6] == SEAL_COMPRESSION_NONE) {
                r = crypto_aes256gcm_decrypt(key, b, SEAL_HEADER_LEN, b + SEAL_HEADER_LEN, data_len,
                                             b + SEAL_HEADER_LEN + data_len, payload);
                if (r < 0) {
                        log_debug("failed to open sealed blob: GCM authentication failed");
                        goto out_payload;
                }
        } else {
                data = malloc(data_len ? data_len : 1);
                if (!data) {
                        r = -ENOMEM;
                        goto out_payload;
                }
                r = crypto_aes256gcm_decrypt(key, b, SEAL_HEADER_LEN, b + SEAL_HEADER_LEN, data_len,
                                             b + SEAL_HEADER_LEN + data_len, data);
                if (r < 0) {
                        log_debug("failed to open sealed blob: GCM authentication failed");
                        goto out_data;
                }
                /* compress.c logs why a frame is refused. */
                r = compress_decompress_exact(data, data_len, payload, (size_t) payload_len);
                if (r < 0)
                        goto out_data;
        }

        payload[payload_len] = 0;
        *ret_payload = payload;
        *ret_len = (size_t) payload_len;
        payload = NULL;
out_data:
        crypto_wipe(data, data_len);
        free(data);
out_payload:
        if (payload) {
                crypto_wipe(payload, (size_t) payload_len);
                free(payload);
        }
out_key:
        crypto_wipe(key, sizeof(key));
        return r;
}
