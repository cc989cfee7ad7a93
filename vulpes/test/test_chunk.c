/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Tests for chunk.c (with compress.c and seal.c underneath): round trips, zero-chunk detection, chunk
 * lengths, and rejection of every single-byte change and every truncation of an object, including objects
 * that are correctly named and encrypted but whose body is wrong.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "chunk.h"
#include "compress.h"
#include "crypto.h"
#include "seal.h"

typedef struct Encoded {
        uint8_t *object;
        size_t len;
        uint8_t tag[CHUNK_TAG_LEN];
        uint8_t key[CHUNK_KEY_LEN];
        uint8_t flags;
} Encoded;

static const uint8_t secret[CHUNK_SECRET_LEN] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 };

static void encode(const void *plaintext, size_t n, Encoded *ret) {
        ret->object = malloc(chunk_object_max_len(n));
        assert_non_null(ret->object);
        assert_int_equal(chunk_encode(plaintext, n, secret, COMPRESS_LEVEL_DEFAULT, ret->object, &ret->len, ret->tag,
                                      ret->key, &ret->flags),
                         0);
}

/* Decoding must fail and leave only zeros in the output buffer. */
static void assert_rejected(const void *object, size_t len, const uint8_t *tag, const uint8_t *key, size_t n) {
        uint8_t *out = malloc(n);

        assert_non_null(out);
        memset(out, 0xa5, n);
        assert_int_equal(chunk_decode(object, len, tag, key, n, out), -EBADMSG);
        assert_true(chunk_is_zero(out, n));
        free(out);
}

static void assert_round_trip(const uint8_t *plaintext, size_t n, uint8_t expected_flags) {
        Encoded e;
        uint8_t *out = malloc(n);

        assert_non_null(out);
        encode(plaintext, n, &e);
        assert_int_equal(e.flags, expected_flags);
        assert_true(e.len <= chunk_object_max_len(n));
        if (expected_flags == 0)
                assert_int_equal(e.len, n + CHUNK_OVERHEAD);
        else
                assert_true(e.len < n + CHUNK_OVERHEAD);
        assert_int_equal(chunk_decode(e.object, e.len, e.tag, e.key, n, out), 0);
        assert_memory_equal(out, plaintext, n);
        free(out);
        free(e.object);
}

static uint8_t *random_buffer(size_t n) {
        uint8_t *p = malloc(n);

        assert_non_null(p);
        assert_int_equal(crypto_random_bytes(p, n), 0);
        return p;
}

static uint8_t *text_buffer(size_t n) {
        static const char words[] = "the quick brown fox jumps over the lazy dog ";
        uint8_t *p = malloc(n);

        assert_non_null(p);
        for (size_t i = 0; i < n; i++)
                p[i] = (uint8_t) words[i % (sizeof(words) - 1)];
        return p;
}

static void test_round_trips(void **state) {
        static const size_t lengths[] = { 1, 2, 27, 28, 29, 100, 511, 4095, 4096, 65537, CHUNK_SIZE_DEFAULT, CHUNK_SIZE_MAX };

        (void) state;
        for (size_t i = 0; i < sizeof(lengths) / sizeof(lengths[0]); i++) {
                uint8_t *random = random_buffer(lengths[i]), *text = text_buffer(lengths[i]);

                assert_round_trip(random, lengths[i], 0);
                /* Tiny inputs do not shrink under zstd (its frame header alone is several bytes). */
                assert_round_trip(text, lengths[i], lengths[i] >= 100 ? CHUNK_FLAG_ZSTD : 0);
                free(random);
                free(text);
        }
}

static void test_convergent(void **state) {
        uint8_t *p = text_buffer(8192);
        uint8_t other_secret[CHUNK_SECRET_LEN] = { 9 };
        Encoded a, b;
        uint8_t *object = malloc(chunk_object_max_len(8192)), tag[CHUNK_TAG_LEN], key[CHUNK_KEY_LEN], flags;
        size_t len;

        (void) state;
        encode(p, 8192, &a);
        encode(p, 8192, &b);
        assert_int_equal(a.len, b.len);
        assert_memory_equal(a.object, b.object, a.len);
        assert_memory_equal(a.tag, b.tag, CHUNK_TAG_LEN);
        assert_memory_equal(a.key, b.key, CHUNK_KEY_LEN);
        assert_int_equal(chunk_encode(p, 8192, other_secret, COMPRESS_LEVEL_DEFAULT, object, &len, tag, key, &flags), 0);
        assert_memory_not_equal(tag, a.tag, CHUNK_TAG_LEN);
        assert_memory_not_equal(key, a.key, CHUNK_KEY_LEN);
        assert_int_equal(chunk_encode(p, 0, secret, 3, object, &len, tag, key, &flags), -EINVAL);
        free(object);
        free(a.object);
        free(b.object);
        free(p);
}

static void test_zero_detection(void **state) {
        uint8_t buf[4096] = { 0 };

        (void) state;
        assert_true(chunk_is_zero(buf, sizeof(buf)));
        assert_true(chunk_is_zero(buf, 1));
        assert_true(chunk_is_zero(buf, 0));
        for (size_t i = 0; i < sizeof(buf); i += 511) {
                buf[i] = 1;
                assert_false(chunk_is_zero(buf, sizeof(buf)));
                buf[i] = 0;
        }
        buf[sizeof(buf) - 1] = 0x80;
        assert_false(chunk_is_zero(buf, sizeof(buf)));
        assert_true(chunk_is_zero(buf, sizeof(buf) - 1));
}

static void test_lengths(void **state) {
        (void) state;
        assert_true(chunk_size_valid(4096));
        assert_true(chunk_size_valid(131072));
        assert_true(chunk_size_valid(4194304));
        assert_false(chunk_size_valid(2048));
        assert_false(chunk_size_valid(8388608));
        assert_false(chunk_size_valid(131073));
        assert_false(chunk_size_valid(0));
        assert_int_equal(chunk_count(0, 4096), 0);
        assert_int_equal(chunk_count(1, 4096), 1);
        assert_int_equal(chunk_count(8192, 4096), 2);
        assert_int_equal(chunk_count(8193, 4096), 3);
        assert_int_equal(chunk_length(8193, 4096, 0), 4096);
        assert_int_equal(chunk_length(8193, 4096, 1), 4096);
        assert_int_equal(chunk_length(8193, 4096, 2), 1);
        assert_int_equal(chunk_length(8193, 4096, 3), 0);
        assert_int_equal(chunk_length(8192, 4096, 2), 0);
        assert_int_equal(chunk_length(UINT64_C(1) << 40, 131072, (UINT64_C(1) << 23) - 1), 131072);
}

/* Every byte of the object, changed, must be rejected: under the stored tag (fails check 1) and under the
 * tag of the changed object (so that the later checks must catch it). */
static void check_every_byte_flip(const uint8_t *plaintext, size_t n, uint8_t expected_flags) {
        Encoded e;
        uint8_t tag[CHUNK_TAG_LEN];

        encode(plaintext, n, &e);
        assert_int_equal(e.flags, expected_flags);
        for (size_t i = 0; i < e.len; i++) {
                for (unsigned bit = 0; bit < 8; bit += 7) {
                        e.object[i] ^= (uint8_t) (1u << bit);
                        assert_rejected(e.object, e.len, e.tag, e.key, n);
                        assert_int_equal(crypto_sha256(e.object, e.len, tag), 0);
                        assert_rejected(e.object, e.len, tag, e.key, n);
                        e.object[i] ^= (uint8_t) (1u << bit);
                }
        }
        free(e.object);
}

static void test_byte_flips_rejected(void **state) {
        uint8_t *text = text_buffer(4096), *random = random_buffer(4096);

        (void) state;
        check_every_byte_flip(text, 4096, CHUNK_FLAG_ZSTD);
        check_every_byte_flip(random, 4096, 0);
        check_every_byte_flip(random, 1, 0);
        free(text);
        free(random);
}

static void test_truncations_rejected(void **state) {
        uint8_t *text = text_buffer(4096), *random = random_buffer(1000), tag[CHUNK_TAG_LEN];
        Encoded e[2];

        (void) state;
        encode(text, 4096, &e[0]);
        encode(random, 1000, &e[1]);
        for (int j = 0; j < 2; j++) {
                size_t n = j == 0 ? 4096 : 1000;

                for (size_t len = 0; len < e[j].len; len++) {
                        assert_rejected(e[j].object, len, e[j].tag, e[j].key, n);
                        assert_int_equal(crypto_sha256(e[j].object, len, tag), 0);
                        assert_rejected(e[j].object, len, tag, e[j].key, n);
                }
        }
        free(e[0].object);
        free(e[1].object);
        free(text);
        free(random);
}

static void test_wrong_inputs_rejected(void **state) {
        uint8_t *text = text_buffer(5000), key[CHUNK_KEY_LEN];
        Encoded e;

        (void) state;
        encode(text, 5000, &e);
        assert_rejected(e.object, e.len, e.tag, e.key, 4999);
        assert_rejected(e.object, e.len, e.tag, e.key, 5001);
        memcpy(key, e.key, sizeof(key));
        key[0] ^= 1;
        assert_rejected(e.object, e.len, e.tag, key, 5000);
        free(e.object);
        free(text);
}

/* Builds a correctly named and encrypted object from any header fields and body, as a hostile or buggy
 * writer could, so that the checks after GCM are reached. */
static size_t forge(uint8_t compression, uint32_t n, const void *body, size_t body_len, uint8_t *ret_object,
                    uint8_t ret_tag[CHUNK_TAG_LEN], uint8_t ret_key[CHUNK_KEY_LEN]) {
        uint8_t *h = ret_object;
        const CryptoBuffer parts[] = { { "isr-chunk-v1", 12 }, { h, CHUNK_HEADER_LEN }, { body, body_len } };

        memcpy(h, "ISRC", 4);
        h[4] = 1;
        h[5] = compression;
        h[6] = h[7] = 0;
        h[8] = (uint8_t) (n >> 24);
        h[9] = (uint8_t) (n >> 16);
        h[10] = (uint8_t) (n >> 8);
        h[11] = (uint8_t) n;
        assert_int_equal(crypto_hmac_sha256(secret, CHUNK_SECRET_LEN, parts, 3, ret_key), 0);
        assert_int_equal(crypto_aes256gcm_encrypt(ret_key, h, CHUNK_HEADER_LEN, body, body_len, h + CHUNK_HEADER_LEN,
                                                  h + CHUNK_HEADER_LEN + body_len),
                         0);
        assert_int_equal(crypto_sha256(ret_object, body_len + CHUNK_OVERHEAD, ret_tag), 0);
        return body_len + CHUNK_OVERHEAD;
}

static void test_forged_bodies_rejected(void **state) {
        uint8_t *text = text_buffer(8192), *z = malloc(compress_bound(8192) * 2 + 16), *object = malloc(40000), *out = malloc(8192);
        uint8_t tag[CHUNK_TAG_LEN], key[CHUNK_KEY_LEN];
        size_t zlen, z2len, len;

        (void) state;
        assert_int_equal(compress_frame(text, 4096, 3, z, compress_bound(4096), &zlen), 0);

        /* The forger itself is right: a well-formed object decodes. */
        len = forge(1, 4096, z, zlen, object, tag, key);
        assert_int_equal(chunk_decode(object, len, tag, key, 4096, out), 0);
        assert_memory_equal(out, text, 4096);

        /* A frame for fewer bytes than the header says. */
        assert_int_equal(compress_frame(text, 4095, 3, z, compress_bound(4095), &z2len), 0);
        len = forge(1, 4096, z, z2len, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);

        /* A frame for more bytes than the header says. */
        assert_int_equal(compress_frame(text, 4097, 3, z, compress_bound(4097), &z2len), 0);
        len = forge(1, 4096, z, z2len, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);

        /* Trailing data after the frame, and two frames. */
        assert_int_equal(compress_frame(text, 4096, 3, z, compress_bound(4096), &zlen), 0);
        z[zlen] = 0;
        len = forge(1, 4096, z, zlen + 1, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);
        assert_int_equal(compress_frame(text, 2048, 3, z, compress_bound(2048), &zlen), 0);
        assert_int_equal(compress_frame(text, 2048, 3, z + zlen, compress_bound(2048), &z2len), 0);
        len = forge(1, 4096, z, zlen + z2len, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);

        /* A truncated frame. */
        assert_int_equal(compress_frame(text, 4096, 3, z, compress_bound(4096), &zlen), 0);
        len = forge(1, 4096, z, zlen - 1, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);

        /* Not a frame at all, an empty body, and a skippable frame. */
        len = forge(1, 4096, text, 100, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);
        len = forge(1, 4096, text, 0, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);
        memcpy(z, "\x50\x2a\x4d\x18\x00\x00\x00\x00", 8);
        len = forge(1, 4096, z, 8, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);

        /* Uncompressed bodies of the wrong length, and an unknown compression value. */
        len = forge(0, 4096, text, 4095, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);
        len = forge(0, 4096, text, 4097, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);
        len = forge(2, 4096, text, 4096, object, tag, key);
        assert_rejected(object, len, tag, key, 4096);

        /* A compressed body larger than n (zstd of random bytes) is still a valid object. */
        assert_int_equal(crypto_random_bytes(out, 4096), 0);
        assert_int_equal(compress_frame(out, 4096, 3, z, compress_bound(4096), &zlen), 0);
        assert_true(zlen > 4096);
        len = forge(1, 4096, z, zlen, object, tag, key);
        assert_int_equal(chunk_decode(object, len, tag, key, 4096, text), 0);
        assert_memory_equal(out, text, 4096);

        free(out);
        free(object);
        free(z);
        free(text);
}

static void test_sealed_blobs(void **state) {
        uint8_t pk[SEAL_PARCEL_KEY_LEN] = { 7 }, other[SEAL_PARCEL_KEY_LEN] = { 8 }, *text = text_buffer(10000);
        uint8_t *blob = NULL, *blob2 = NULL, *payload = NULL;
        size_t blob_len, blob2_len, len;

        (void) state;
        assert_int_equal(seal_blob(pk, SEAL_KIND_DEVICE_STATE, text, 10000, 3, &blob, &blob_len), 0);
        assert_true(blob_len < 10000);
        assert_int_equal(blob[6], 1);
        assert_int_equal(seal_open(pk, blob, blob_len, SEAL_KIND_DEVICE_STATE, 10000, &payload, &len), 0);
        assert_int_equal(len, 10000);
        assert_memory_equal(payload, text, 10000);
        free(payload);
        payload = NULL;

        /* Fresh salt on every seal. */
        assert_int_equal(seal_blob(pk, SEAL_KIND_DEVICE_STATE, text, 10000, 3, &blob2, &blob2_len), 0);
        assert_memory_not_equal(blob + 8, blob2 + 8, 32);
        free(blob2);

        assert_int_equal(seal_open(pk, blob, blob_len, SEAL_KIND_BOOT_FILE, 10000, &payload, &len), -EBADMSG);
        assert_int_equal(seal_open(pk, blob, blob_len, SEAL_KIND_DEVICE_STATE, 9999, &payload, &len), -EBADMSG);
        assert_int_equal(seal_open(other, blob, blob_len, SEAL_KIND_DEVICE_STATE, 10000, &payload, &len), -EBADMSG);
        for (size_t i = 0; i < blob_len; i++) {
                blob[i] ^= 0x01;
                assert_int_equal(seal_open(pk, blob, blob_len, SEAL_KIND_DEVICE_STATE, 10000, &payload, &len), -EBADMSG);
                blob[i] ^= 0x01;
        }
        for (size_t l = 0; l < blob_len; l++)
                assert_int_equal(seal_open(pk, blob, l, SEAL_KIND_DEVICE_STATE, 10000, &payload, &len), -EBADMSG);
        assert_null(payload);
        free(blob);

        /* Incompressible and empty payloads are stored uncompressed; level 0 never compresses. */
        assert_int_equal(seal_blob(pk, SEAL_KIND_KEYRING, "", 0, 3, &blob, &blob_len), 0);
        assert_int_equal(blob_len, SEAL_OVERHEAD);
        assert_int_equal(blob[6], 0);
        assert_int_equal(seal_open(pk, blob, blob_len, SEAL_KIND_KEYRING, 0, &payload, &len), 0);
        assert_int_equal(len, 0);
        free(payload);
        free(blob);
        assert_int_equal(seal_blob(pk, SEAL_KIND_MANIFEST, text, 10000, 0, &blob, &blob_len), 0);
        assert_int_equal(blob[6], 0);
        assert_int_equal(blob_len, 10000 + SEAL_OVERHEAD);
        assert_int_equal(seal_open(pk, blob, blob_len, SEAL_KIND_MANIFEST, 10000, &payload, &len), 0);
        assert_memory_equal(payload, text, 10000);
        free(payload);
        free(blob);
        free(text);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_round_trips),
                cmocka_unit_test(test_convergent),
                cmocka_unit_test(test_zero_detection),
                cmocka_unit_test(test_lengths),
                cmocka_unit_test(test_byte_flips_rejected),
                cmocka_unit_test(test_truncations_rejected),
                cmocka_unit_test(test_wrong_inputs_rejected),
                cmocka_unit_test(test_forged_bodies_rejected),
                cmocka_unit_test(test_sealed_blobs),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
