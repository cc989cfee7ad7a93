/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Key envelopes (envelope.c).  Input: a mode byte, then:
 *   0  an envelope, unwrapped with a fixed key file;
 *   1  an envelope, unwrapped with a fixed passphrase; scrypt parameters that cost more than 4 MiB are
 *      skipped (they are valid up to 1 GiB and would only measure scrypt);
 *   2  a key file: envelope_wrap then envelope_unwrap must give back the UUID and both keys.
 * An unwrap either succeeds or fails with -EBADMSG (a wrong credential and a damaged envelope alike).
 */
#include <errno.h>

#include "envelope.h"
#include "fuzz.h"

static const uint8_t keyfile[32] = "fuzz key file, thirty-two bytes";
static const uint8_t secret[ENVELOPE_KEY_LEN] = "a convergence secret of 32 bytes";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        uint8_t uuid[ENVELOPE_UUID_LEN], pk[ENVELOPE_KEY_LEN], cs[ENVELOPE_KEY_LEN], e[ENVELOPE_LEN];
        EnvelopeCredential credential = { ENVELOPE_KDF_KEYFILE, keyfile, sizeof(keyfile) };
        const uint8_t *envelope;
        size_t len;
        int r;

        if (size < 1)
                return 0;
        envelope = data + 1;
        len = size - 1;
        switch (data[0] % 3) {
        case 1:
                if (len == ENVELOPE_LEN && envelope[5] == ENVELOPE_KDF_SCRYPT) {
                        uint64_t log2n = envelope[56], r_param = fuzz_be(envelope + 60, 4),
                                 p_param = fuzz_be(envelope + 64, 4);

                        /* Parameters out of range are refused before scrypt runs: those are worth fuzzing. */
                        if (log2n <= 22 && r_param <= 32 && p_param <= 16 &&
                            128 * r_param * p_param * ((uint64_t) 1 << log2n) > (4u << 20))
                                return 0;
                }
                credential = (EnvelopeCredential) { ENVELOPE_KDF_SCRYPT, "fuzz", 4 };
                /* fall through */
        case 0:
                r = envelope_unwrap(&credential, envelope, len, uuid, pk, cs);
                FUZZ_CHECK(r == 0 || r == -EBADMSG, "envelope_unwrap returned neither 0 nor -EBADMSG");
                break;
        case 2:
                if (len < ENVELOPE_KEYFILE_MIN || len > ENVELOPE_KEYFILE_MAX)
                        return 0;
                credential = (EnvelopeCredential) { ENVELOPE_KDF_KEYFILE, envelope, len };
                FUZZ_CHECK(envelope_wrap(&credential, NULL, data + 1, fuzz_key, secret, e) == 0,
                           "envelope_wrap failed");
                FUZZ_CHECK(envelope_unwrap(&credential, e, sizeof(e), uuid, pk, cs) == 0, "a wrapped envelope does not unwrap");
                FUZZ_CHECK(memcmp(uuid, data + 1, sizeof(uuid)) == 0 && memcmp(pk, fuzz_key, sizeof(pk)) == 0 &&
                                   memcmp(cs, secret, sizeof(cs)) == 0,
                           "an envelope did not round-trip");
                break;
        }
        return 0;
}
