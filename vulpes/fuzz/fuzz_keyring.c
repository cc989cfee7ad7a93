/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Keyring streams (keyring.c).  Input: a stream, as it came out of a sealed keyring blob.  A stream that
 * decodes is canonical, so it must come back byte for byte from keyring_stream_encode(), and from a real
 * keyring database after keyring_import_stream() (its digest too); one that does not decode must leave
 * the database as it was.
 */
#include <errno.h>
#include <unistd.h>

#include "crypto.h"
#define FUZZ_OWN_INITIALIZE
#include "fuzz.h"
#include "keyring.h"

static Keyring *keyring;
static char dir[] = "/tmp/fuzz_keyring.XXXXXX";

static void cleanup(void) {
        char path[64];

        keyring = keyring_free(keyring);
        for (const char *const *suffix = (const char *const[]) { "", "-wal", "-shm", NULL }; *suffix; suffix++) {
                snprintf(path, sizeof(path), "%s/keyring%s", dir, *suffix);
                unlink(path);
        }
        rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        char path[64];

        (void) argc;
        (void) argv;
        fuzz_quiet_logs();
        FUZZ_CHECK(mkdtemp(dir), "cannot make a temporary directory");
        snprintf(path, sizeof(path), "%s/keyring", dir);
        FUZZ_CHECK(keyring_create(path, 131072, 1 << 20, &keyring) == 0, "cannot create a keyring");
        atexit(cleanup);
        return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        KeyringRecord *records = NULL;
        uint8_t *stream = NULL, digest[KEYRING_DIGEST_LEN], want[KEYRING_DIGEST_LEN];
        uint64_t image_size = 0, stream_len = 0;
        uint32_t chunk_size = 0;
        size_t n = 0, len = 0;
        int r;

        r = keyring_stream_decode(data, size, &chunk_size, &image_size, &records, &n);
        FUZZ_CHECK(r == 0 || r == -EBADMSG, "keyring_stream_decode returned neither 0 nor -EBADMSG");
        if (r < 0) {
                FUZZ_CHECK(keyring_import_stream(keyring, data, size) == -EBADMSG, "a refused stream was imported");
                return 0;
        }
        FUZZ_CHECK(keyring_stream_encode(chunk_size, image_size, records, n, &stream, &len) == 0,
                   "a decoded stream does not encode");
        FUZZ_CHECK(len == size && memcmp(stream, data, size) == 0, "a decoded stream does not encode to itself");
        free(stream);
        free(records);

        r = keyring_import_stream(keyring, data, size);
        if (image_size > KEYRING_IMAGE_SIZE_MAX) {
                FUZZ_CHECK(r == -ERANGE, "an image size sqlite cannot hold was imported");
                return 0;
        }
        FUZZ_CHECK(r == 0, "a valid stream was not imported");
        FUZZ_CHECK(keyring_export_stream(keyring, &stream, &len) == 0, "the keyring does not export");
        FUZZ_CHECK(len == size && memcmp(stream, data, size) == 0, "an imported stream does not export to itself");
        free(stream);
        FUZZ_CHECK(keyring_digest(keyring, digest, &stream_len) == 0, "the keyring has no digest");
        crypto_sha256(data, size, want);
        FUZZ_CHECK(stream_len == size && memcmp(digest, want, sizeof(want)) == 0, "the keyring digest is wrong");
        return 0;
}
