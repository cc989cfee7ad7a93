/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Known-answer tests for crypto.c: SHA-256 (FIPS 180-2), HMAC-SHA256 (RFC 4231), AES-256-GCM with a zero
 * nonce (GCM specification test cases 13 and 14), AES-256 key wrap (RFC 3394 §4.6) and scrypt (RFC 7914).
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "crypto.h"
#include "hex.h"

static void assert_hex_equal(const void *data, size_t len, const char *expected) {
        char *s = malloc(2 * len + 1);

        assert_non_null(s);
        hex_encode(data, len, s);
        assert_string_equal(s, expected);
        free(s);
}

static void test_sha256_abc(void **state) {
        uint8_t digest[CRYPTO_SHA256_LEN];

        (void) state;
        assert_int_equal(crypto_sha256("abc", 3, digest), 0);
        assert_hex_equal(digest, sizeof(digest), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

static void test_sha256_incremental(void **state) {
        uint8_t digest[CRYPTO_SHA256_LEN], one_shot[CRYPTO_SHA256_LEN];
        const char *msg = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
        CryptoSha256 *s = NULL;

        (void) state;
        assert_int_equal(crypto_sha256_new(&s), 0);
        for (size_t i = 0; i < strlen(msg); i += 5)
                assert_int_equal(crypto_sha256_update(s, msg + i, strlen(msg) - i < 5 ? strlen(msg) - i : 5), 0);
        assert_int_equal(crypto_sha256_final(s, digest), 0);
        assert_null(crypto_sha256_free(s));
        assert_hex_equal(digest, sizeof(digest), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
        assert_int_equal(crypto_sha256(msg, strlen(msg), one_shot), 0);
        assert_memory_equal(digest, one_shot, sizeof(digest));
        assert_null(crypto_sha256_free(NULL));
}

static void test_hmac_rfc4231_case2(void **state) {
        uint8_t mac[CRYPTO_SHA256_LEN];
        const CryptoBuffer whole = { "what do ya want for nothing?", 28 };
        const CryptoBuffer pieces[] = { { "what do ya ", 11 }, { "", 0 }, { "want for nothing?", 17 } };

        (void) state;
        assert_int_equal(crypto_hmac_sha256("Jefe", 4, &whole, 1, mac), 0);
        assert_hex_equal(mac, sizeof(mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        assert_int_equal(crypto_hmac_sha256("Jefe", 4, pieces, 3, mac), 0);
        assert_hex_equal(mac, sizeof(mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

static void test_hmac_rfc4231_case6_long_key(void **state) {
        uint8_t key[131], mac[CRYPTO_SHA256_LEN];
        const char *msg = "Test Using Larger Than Block-Size Key - Hash Key First";
        const CryptoBuffer part = { msg, strlen(msg) };

        (void) state;
        memset(key, 0xaa, sizeof(key));
        assert_int_equal(crypto_hmac_sha256(key, sizeof(key), &part, 1, mac), 0);
        assert_hex_equal(mac, sizeof(mac), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

static void test_gcm_zero_nonce(void **state) {
        uint8_t key[CRYPTO_KEY_LEN] = { 0 }, pt[16] = { 0 }, ct[16], tag[CRYPTO_GCM_TAG_LEN], back[16];

        (void) state;
        /* Test case 13: empty plaintext. */
        assert_int_equal(crypto_aes256gcm_encrypt(key, NULL, 0, NULL, 0, NULL, tag), 0);
        assert_hex_equal(tag, sizeof(tag), "530f8afbc74536b9a963b4f1c4cb738b");
        assert_int_equal(crypto_aes256gcm_decrypt(key, NULL, 0, NULL, 0, tag, NULL), 0);

        /* Test case 14: one zero block. */
        assert_int_equal(crypto_aes256gcm_encrypt(key, NULL, 0, pt, sizeof(pt), ct, tag), 0);
        assert_hex_equal(ct, sizeof(ct), "cea7403d4d606b6e074ec5d3baf39d18");
        assert_hex_equal(tag, sizeof(tag), "d0d1c8a799996bf0265b98b5d48ab919");
        assert_int_equal(crypto_aes256gcm_decrypt(key, NULL, 0, ct, sizeof(ct), tag, back), 0);
        assert_memory_equal(back, pt, sizeof(pt));

        /* Associated data is authenticated, and a failed check leaves no plaintext behind. */
        assert_int_equal(crypto_aes256gcm_decrypt(key, "x", 1, ct, sizeof(ct), tag, back), -EBADMSG);
        tag[0] ^= 1;
        memset(back, 0x55, sizeof(back));
        assert_int_equal(crypto_aes256gcm_decrypt(key, NULL, 0, ct, sizeof(ct), tag, back), -EBADMSG);
        assert_memory_equal(back, pt, sizeof(pt));
}

static void test_gcm_in_place_with_aad(void **state) {
        uint8_t key[CRYPTO_KEY_LEN], buf[1000], orig[1000], tag[CRYPTO_GCM_TAG_LEN];

        (void) state;
        assert_int_equal(crypto_random_bytes(key, sizeof(key)), 0);
        assert_int_equal(crypto_random_bytes(orig, sizeof(orig)), 0);
        memcpy(buf, orig, sizeof(buf));
        assert_int_equal(crypto_aes256gcm_encrypt(key, "header", 6, buf, sizeof(buf), buf, tag), 0);
        assert_memory_not_equal(buf, orig, sizeof(buf));
        assert_int_equal(crypto_aes256gcm_decrypt(key, "header", 6, buf, sizeof(buf), tag, buf), 0);
        assert_memory_equal(buf, orig, sizeof(buf));
}

static void test_keywrap_rfc3394_4_6(void **state) {
        uint8_t kek[32], key[32], wrapped[40], back[32];

        (void) state;
        assert_int_equal(hex_decode_exact("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f", kek, 32), 0);
        assert_int_equal(hex_decode_exact("00112233445566778899aabbccddeeff000102030405060708090a0b0c0d0e0f", key, 32), 0);
        assert_int_equal(crypto_aes256_keywrap(kek, key, sizeof(key), wrapped), 0);
        assert_hex_equal(wrapped, sizeof(wrapped),
                         "28c9f404c4b810f4cbccb35cfb87f8263f5786e2d80ed326cbc7f0e71a99f43bfb988b9b7a02dd21");
        assert_int_equal(crypto_aes256_keyunwrap(kek, wrapped, sizeof(wrapped), back), 0);
        assert_memory_equal(back, key, sizeof(key));

        /* The integrity check catches any altered bit and a wrong KEK. */
        for (size_t i = 0; i < sizeof(wrapped); i++) {
                wrapped[i] ^= 0x10;
                assert_int_equal(crypto_aes256_keyunwrap(kek, wrapped, sizeof(wrapped), back), -EBADMSG);
                wrapped[i] ^= 0x10;
        }
        kek[31] ^= 1;
        assert_int_equal(crypto_aes256_keyunwrap(kek, wrapped, sizeof(wrapped), back), -EBADMSG);
        assert_int_equal(crypto_aes256_keywrap(kek, key, 12, wrapped), -EINVAL);
}

static void test_scrypt_rfc7914(void **state) {
        uint8_t key[64];

        (void) state;
        /* RFC 7914 §12, second vector: N = 1024, r = 8, p = 16. */
        assert_int_equal(crypto_scrypt("password", 8, "NaCl", 4, 10, 8, 16, key, sizeof(key)), 0);
        assert_hex_equal(key, sizeof(key),
                         "fdbabe1c9d3472007856e7190d01e9fe7c6ad7cbc8237830e77376634b3731622eaf30d92e22a3886ff109279d9830dac727afb94a83ee6d8360cbdfa2cc0640");
        /* RFC 7914 §12, first vector: empty password and salt, N = 16, r = 1, p = 1. */
        assert_int_equal(crypto_scrypt("", 0, "", 0, 4, 1, 1, key, sizeof(key)), 0);
        assert_hex_equal(key, sizeof(key),
                         "77d6576238657b203b19ca42c18a0497f16b4844e3074ae8dfdffa3fede21442fcd0069ded0948f8326a753a0fc81f17e8d3e0fb2e0d3628cf35e20c38d18906");
}

static void test_scrypt_default_parameters_fit(void **state) {
        uint8_t key[32];

        (void) state;
        /* N = 2^15, r = 8 needs 32 MiB, more than OpenSSL's default limit: the explicit maxmem must allow it. */
        assert_int_equal(crypto_scrypt("pw", 2, "salt", 4, 15, 8, 1, key, sizeof(key)), 0);
}

static void test_random_and_wipe(void **state) {
        uint8_t a[64] = { 0 }, b[64] = { 0 }, zero[64] = { 0 };

        (void) state;
        assert_int_equal(crypto_random_bytes(a, sizeof(a)), 0);
        assert_int_equal(crypto_random_bytes(b, sizeof(b)), 0);
        assert_memory_not_equal(a, b, sizeof(a));
        crypto_wipe(a, sizeof(a));
        assert_memory_equal(a, zero, sizeof(a));
        crypto_wipe(NULL, 10);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_sha256_abc),
                cmocka_unit_test(test_sha256_incremental),
                cmocka_unit_test(test_hmac_rfc4231_case2),
                cmocka_unit_test(test_hmac_rfc4231_case6_long_key),
                cmocka_unit_test(test_gcm_zero_nonce),
                cmocka_unit_test(test_gcm_in_place_with_aad),
                cmocka_unit_test(test_keywrap_rfc3394_4_6),
                cmocka_unit_test(test_scrypt_rfc7914),
                cmocka_unit_test(test_scrypt_default_parameters_fit),
                cmocka_unit_test(test_random_and_wipe),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
