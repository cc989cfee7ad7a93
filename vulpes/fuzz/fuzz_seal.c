/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Sealed blobs (seal.c).  Input: a mode byte, the expected kind byte, then the mode's bytes:
 *   0  a blob, opened under the fixed parcel key as it came from a server (seal_open);
 *   1  a compression byte, a 4-byte payload length and a body: the harness builds the header and
 *      encrypts the body, so that what follows GCM (the length check, the zstd frame) sees the fuzzer's bytes;
 *   2  a payload: seal_blob then seal_open must give it back.
 * An open either gives exactly the header's length (NUL-terminated) or fails with -EBADMSG.
 */
#include <errno.h>

#include "crypto.h"
#include "fuzz.h"
#include "seal.h"

/* Payloads above this are refused as a caller's max_length would; it keeps the fuzzer's memory small. */
#define MAX_LENGTH ((uint64_t) 1 << 22)

static void open_checked(const uint8_t *blob, size_t len, SealKind kind) {
        uint8_t *payload = NULL;
        size_t payload_len = 0;
        int r;

        r = seal_open(fuzz_key, blob, len, kind, MAX_LENGTH, &payload, &payload_len);
        FUZZ_CHECK(r == 0 || r == -EBADMSG, "seal_open returned neither 0 nor -EBADMSG");
        if (r == 0) {
                FUZZ_CHECK(payload_len <= MAX_LENGTH, "seal_open returned more than max_length");
                FUZZ_CHECK(payload_len == fuzz_be(blob + 40, 8), "the payload is not as long as the header says");
                FUZZ_CHECK(payload[payload_len] == 0, "the payload is not NUL-terminated");
                free(payload);
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        uint8_t key[CRYPTO_KEY_LEN], *blob, *payload;
        size_t body_len, blob_len, payload_len;
        SealKind kind;

        if (size < 2)
                return 0;
        kind = (SealKind) data[1];
        switch (data[0] % 3) {
        case 0:
                open_checked(data + 2, size - 2, kind);
                break;
        case 1: {
                static const uint8_t salt[32] = { 1 };
                const CryptoBuffer parts[] = { { "isr-blob-v1", 11 }, { salt, sizeof(salt) } };

                if (size < 7)
                        return 0;
                body_len = size - 7;
                blob = malloc(SEAL_OVERHEAD + body_len);
                FUZZ_CHECK(blob, "out of memory");
                memcpy(blob, "ISRB", 4);
                blob[4] = 1;
                blob[5] = data[1];
                blob[6] = data[2];
                blob[7] = 0;
                memcpy(blob + 8, salt, sizeof(salt));
                memset(blob + 40, 0, 4);
                memcpy(blob + 44, data + 3, 4);
                crypto_hmac_sha256(fuzz_key, sizeof(fuzz_key), parts, 2, key);
                crypto_aes256gcm_encrypt(key, blob, SEAL_HEADER_LEN, data + 7, body_len, blob + SEAL_HEADER_LEN,
                                         blob + SEAL_HEADER_LEN + body_len);
                open_checked(blob, SEAL_OVERHEAD + body_len, kind);
                free(blob);
                break;
        }
        case 2:
                if (kind < SEAL_KIND_MANIFEST || kind > SEAL_KIND_BOOT_FILE)
                        return 0;
                FUZZ_CHECK(seal_blob(fuzz_key, kind, data + 2, size - 2, (int) (size % 4), &blob, &blob_len) == 0,
                           "seal_blob failed");
                FUZZ_CHECK(seal_open(fuzz_key, blob, blob_len, kind, size, &payload, &payload_len) == 0,
                           "a sealed blob does not open");
                FUZZ_CHECK(payload_len == size - 2 && memcmp(payload, data + 2, payload_len) == 0,
                           "a sealed blob did not round-trip");
                free(payload);
                free(blob);
                break;
        }
        return 0;
}
