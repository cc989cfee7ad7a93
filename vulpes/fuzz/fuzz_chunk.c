/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Chunk objects (chunk.c).  Input: a mode byte, a 3-byte expected plaintext length n (big-endian, taken
 * modulo CHUNK_SIZE_MAX + 1), then the mode's bytes:
 *   0  an object, decoded as it came from a server or a cache file (chunk_decode, tag = its SHA-256);
 *   1  a compression byte, a 4-byte header length and a body: the harness builds a header and encrypts the
 *      body, so that the checks after GCM (body length, the zstd frame) see bytes of the fuzzer's choosing;
 *   2  a plaintext: chunk_encode then chunk_decode must give it back.
 * A decode either succeeds with n bytes or fails with -EBADMSG and zeros: never anything else.
 */
#include <errno.h>

#include "chunk.h"
#include "crypto.h"
#include "fuzz.h"

static int decode_checked(const uint8_t *object, size_t len, const uint8_t key[CHUNK_KEY_LEN], size_t n) {
        uint8_t tag[CHUNK_TAG_LEN], *out = malloc(n ? n : 1);
        int r;

        FUZZ_CHECK(out, "out of memory");
        crypto_sha256(object, len, tag);
        memset(out, 0xa5, n);
        r = chunk_decode(object, len, tag, key, n, out);
        FUZZ_CHECK(r == 0 || r == -EBADMSG, "chunk_decode returned neither 0 nor -EBADMSG");
        if (r < 0)
                for (size_t i = 0; i < n; i++)
                        FUZZ_CHECK(out[i] == 0, "a refused chunk left plaintext behind");
        free(out);
        return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        uint8_t header[CHUNK_HEADER_LEN], key[CHUNK_KEY_LEN], tag[CHUNK_TAG_LEN], flags, *object;
        size_t n, body_len, object_len;

        if (size < 4)
                return 0;
        n = (size_t) fuzz_be(data + 1, 3) % (CHUNK_SIZE_MAX + 1);
        switch (data[0] % 3) {
        case 0:
                decode_checked(data + 4, size - 4, fuzz_key, n);
                break;
        case 1:
                if (size < 9)
                        return 0;
                body_len = size - 9;
                memcpy(header, "ISRC", 4);
                header[4] = 1;
                header[5] = data[4];
                header[6] = header[7] = 0;
                memcpy(header + 8, data + 5, 4);
                object = malloc(CHUNK_OVERHEAD + body_len);
                FUZZ_CHECK(object, "out of memory");
                memcpy(object, header, CHUNK_HEADER_LEN);
                /* Any key will do: the decoder is handed the same one. */
                crypto_aes256gcm_encrypt(fuzz_key, header, CHUNK_HEADER_LEN, data + 9, body_len, object + CHUNK_HEADER_LEN,
                                         object + CHUNK_HEADER_LEN + body_len);
                decode_checked(object, CHUNK_OVERHEAD + body_len, fuzz_key, n);
                free(object);
                break;
        case 2:
                n = size - 4;
                if (n == 0)
                        return 0;
                object = malloc(chunk_object_max_len(n));
                FUZZ_CHECK(object, "out of memory");
                FUZZ_CHECK(chunk_encode(data + 4, n, fuzz_key, 1, object, &object_len, tag, key, &flags) == 0,
                           "chunk_encode failed");
                FUZZ_CHECK(object_len <= chunk_object_max_len(n), "chunk_encode wrote past its bound");
                {
                        uint8_t *out = malloc(n);

                        FUZZ_CHECK(out, "out of memory");
                        FUZZ_CHECK(chunk_decode(object, object_len, tag, key, n, out) == 0,
                                   "an encoded chunk does not decode");
                        FUZZ_CHECK(memcmp(out, data + 4, n) == 0, "a chunk did not round-trip");
                        free(out);
                }
                free(object);
                break;
        }
        return 0;
}
