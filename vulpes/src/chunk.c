/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Chunk objects: the compressed, convergently encrypted form of one chunk of an image
 * (doc/parcel-format.md, "Chunk objects").  Encoding derives the key from the header and body and names
 * the object by its SHA-256; decoding runs every check of the format before any plaintext is released.
 *
 * Threading: pure functions, safe from any thread.
 */
#include "chunk.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "compress.h"
#include "crypto.h"
#include "log.h"

static const uint8_t chunk_magic[4] = { 'I', 'S', 'R', 'C' };
static const char chunk_key_label[] = "isr-chunk-v1";

enum {
        CHUNK_FORMAT_VERSION = 1,
        CHUNK_COMPRESSION_NONE = 0,
        CHUNK_COMPRESSION_ZSTD = 1,
};

bool chunk_size_valid(uint64_t chunk_size) {
        return chunk_size >= CHUNK_SIZE_MIN && chunk_size <= CHUNK_SIZE_MAX && (chunk_size & (chunk_size - 1)) == 0;
}

uint64_t chunk_count(uint64_t image_size, uint32_t chunk_size) {
        return image_size / chunk_size + (image_size % chunk_size != 0);
}

size_t chunk_length(uint64_t image_size, uint32_t chunk_size, uint64_t idx) {
        uint64_t start;

        if (idx >= chunk_count(image_size, chunk_size))
                return 0;
        start = idx * chunk_size;
        return image_size - start < chunk_size ? (size_t) (image_size - start) : chunk_size;
}

bool chunk_is_zero(const void *data, size_t len) {
        const uint8_t *p = data;

        /* Compare the buffer with itself shifted by one byte once the first byte is known to be zero. */
        return len == 0 || (p[0] == 0 && memcmp(p, p + 1, len - 1) == 0);
}

static void header_build(uint8_t header[CHUNK_HEADER_LEN], unsigned compression, uint32_t n) {
        memcpy(header, chunk_magic, sizeof(chunk_magic));
        header[4] = CHUNK_FORMAT_VERSION;
        header[5] = (uint8_t) compression;
        header[6] = header[7] = 0;
        header[8] = (uint8_t) (n >> 24);
        header[9] = (uint8_t) (n >> 16);
        header[10] = (uint8_t) (n >> 8);
        header[11] = (uint8_t) n;
}

static int key_derive(const uint8_t secret[CHUNK_SECRET_LEN], const uint8_t header[CHUNK_HEADER_LEN],
                      const void *body, size_t body_len, uint8_t ret_key[CHUNK_KEY_LEN]) {
        const CryptoBuffer parts[] = {
                { chunk_key_label, sizeof(chunk_key_label) - 1 },
                { header, CHUNK_HEADER_LEN },
                { body, body_len },
        };

        return crypto_hmac_sha256(secret, CHUNK_SECRET_LEN, parts, 3, ret_key);
}

int chunk_encode(const void *plaintext, size_t n, const uint8_t secret[CHUNK_SECRET_LEN], int level,
                 void *ret_object, size_t *ret_object_len, uint8_t ret_tag[CHUNK_TAG_LEN],
                 uint8_t ret_key[CHUNK_KEY_LEN], uint8_t *ret_flags) {
        uint8_t *object = ret_object, key[CHUNK_KEY_LEN];
        const void *body = plaintext;
        size_t body_len = n, zlen = 0, zcap;
        unsigned compression = CHUNK_COMPRESSION_NONE;
        uint8_t *zbuf;
        int r;

        if (n == 0 || n > CHUNK_SIZE_MAX)
                return -EINVAL;

        zcap = compress_bound(n);
        zbuf = malloc(zcap);
        if (!zbuf)
                return -ENOMEM;
        r = compress_frame(plaintext, n, level, zbuf, zcap, &zlen);
        if (r < 0)
                goto out_zbuf;
        if (zlen < n) {
                body = zbuf;
                body_len = zlen;
                compression = CHUNK_COMPRESSION_ZSTD;
        }

        header_build(object, compression, (uint32_t) n);
        r = key_derive(secret, object, body, body_len, key);
        if (r < 0)
                goto out_zbuf;
        r = crypto_aes256gcm_encrypt(key, object, CHUNK_HEADER_LEN, body, body_len, object + CHUNK_HEADER_LEN,
                                     object + CHUNK_HEADER_LEN + body_len);
        if (r < 0)
                goto out_key;
        r = crypto_sha256(object, body_len + CHUNK_OVERHEAD, ret_tag);
        if (r < 0)
                goto out_key;

        memcpy(ret_key, key, CHUNK_KEY_LEN);
        *ret_object_len = body_len + CHUNK_OVERHEAD;
        *ret_flags = compression == CHUNK_COMPRESSION_ZSTD ? CHUNK_FLAG_ZSTD : 0;
out_key:
        crypto_wipe(key, sizeof(key));
out_zbuf:
        crypto_wipe(zbuf, zlen);
        free(zbuf);
        return r;
}

int chunk_verify_tag(const void *object, size_t object_len, const uint8_t tag[CHUNK_TAG_LEN]) {
        uint8_t digest[CHUNK_TAG_LEN];
        int r;

        r = crypto_sha256(object, object_len, digest);
        if (r < 0)
                return r;
        if (memcmp(digest, tag, CHUNK_TAG_LEN) != 0) {
                log_debug("failed to decode chunk object: SHA-256 does not match its tag");
                return -EBADMSG;
        }
        return 0;
}

/* Check 2: length, magic, version, compression, reserved.  Returns the compression or -EBADMSG. */
static int header_check(const uint8_t *object, size_t object_len) {
        if (object_len < CHUNK_OVERHEAD) {
                log_debug("failed to decode chunk object: %zu bytes is shorter than header and tag", object_len);
                return -EBADMSG;
        }
        if (memcmp(object, chunk_magic, sizeof(chunk_magic)) != 0 || object[4] != CHUNK_FORMAT_VERSION ||
            object[5] > CHUNK_COMPRESSION_ZSTD || object[6] != 0 || object[7] != 0) {
                log_debug("failed to decode chunk object: bad magic, version, compression or reserved bytes");
                return -EBADMSG;
        }
        return object[5];
}

int chunk_decode(const void *object, size_t object_len, const uint8_t tag[CHUNK_TAG_LEN],
                 const uint8_t key[CHUNK_KEY_LEN], size_t n, void *ret_plaintext) {
        int r;

        r = chunk_verify_tag(object, object_len, tag);
        if (r < 0) {
                if (n > 0)
                        memset(ret_plaintext, 0, n);
                return r;
        }
        return chunk_decode_verified(object, object_len, key, n, ret_plaintext);
}

int chunk_decode_verified(const void *object, size_t object_len, const uint8_t key[CHUNK_KEY_LEN], size_t n,
                          void *ret_plaintext) {
        const uint8_t *o = object;
        uint8_t *body = NULL;
        size_t body_len;
        uint32_t header_n;
        int compression, r;

        compression = header_check(o, object_len);
        if (compression < 0) {
                r = compression;
                goto out_wipe;
        }

        header_n = (uint32_t) o[8] << 24 | (uint32_t) o[9] << 16 | (uint32_t) o[10] << 8 | o[11];
        if (header_n != n || n == 0 || n > CHUNK_SIZE_MAX) {
                log_debug("failed to decode chunk object: plaintext length %u, expected %zu", header_n, n);
                r = -EBADMSG;
                goto out_wipe;
        }

        body_len = object_len - CHUNK_OVERHEAD;
        if (compression == CHUNK_COMPRESSION_NONE && body_len == n) {
                /* The common uncompressed case decrypts in place; the GCM layer wipes on failure. */
                r = crypto_aes256gcm_decrypt(key, o, CHUNK_HEADER_LEN, o + CHUNK_HEADER_LEN, body_len,
                                             o + CHUNK_HEADER_LEN + body_len, ret_plaintext);
                if (r < 0) {
                        log_debug("failed to decode chunk object: GCM authentication failed");
                        goto out_wipe;
                }
                return 0;
        }

        body = malloc(body_len ? body_len : 1);
        if (!body) {
                r = -ENOMEM;
                goto out_wipe;
        }
        r = crypto_aes256gcm_decrypt(key, o, CHUNK_HEADER_LEN, o + CHUNK_HEADER_LEN, body_len,
                                     o + CHUNK_HEADER_LEN + body_len, body);
        if (r < 0) {
                log_debug("failed to decode chunk object: GCM authentication failed");
                goto out_body;
        }
        if (compression == CHUNK_COMPRESSION_NONE) {
                log_debug("failed to decode chunk object: uncompressed body of %zu bytes, expected %zu", body_len, n);
                r = -EBADMSG;
                goto out_body;
        }
        /* compress.c logs why a frame is refused. */
        r = compress_decompress_exact(body, body_len, ret_plaintext, n);

out_body:
        crypto_wipe(body, body_len);
        free(body);
out_wipe:
        if (r < 0 && n > 0)
                memset(ret_plaintext, 0, n);
        return r;
}
