/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Key envelopes: the parcel key and convergence secret of one parcel, encrypted under a key derived
 * from a passphrase (scrypt) or a key file (doc/parcel-format.md, "Key envelope").
 *
 * Threading: pure functions, safe from any thread.  Unwrapping with scrypt takes about 0.1 s and
 * 32 MiB with the default parameters, up to 1 GiB with the largest a reader accepts.
 */
#include "envelope.h"

#include <errno.h>
#include <string.h>

#include "crypto.h"
#include "log.h"

static const uint8_t envelope_magic[4] = { 'I', 'S', 'R', 'E' };
static const char keyfile_label[] = "isr-keyfile-v1";

enum {
        ENVELOPE_FORMAT_VERSION = 1,
        ENVELOPE_UUID_OFFSET = 8,
        ENVELOPE_SALT_OFFSET = 24,
        ENVELOPE_SALT_LEN = 32,
        ENVELOPE_LOG2N_OFFSET = 56,
        ENVELOPE_R_OFFSET = 60,
        ENVELOPE_P_OFFSET = 64,
        ENVELOPE_AAD_LEN = 68,
        ENVELOPE_SECRETS_LEN = 2 * ENVELOPE_KEY_LEN,
        ENVELOPE_TAG_OFFSET = ENVELOPE_AAD_LEN + ENVELOPE_SECRETS_LEN,
};

static void put_be32(uint8_t *p, uint32_t v) {
        p[0] = (uint8_t) (v >> 24);
        p[1] = (uint8_t) (v >> 16);
        p[2] = (uint8_t) (v >> 8);
        p[3] = (uint8_t) v;
}

static uint32_t get_be32(const uint8_t *p) {
        return (uint32_t) p[0] << 24 | (uint32_t) p[1] << 16 | (uint32_t) p[2] << 8 | p[3];
}

int envelope_scrypt_params_check(const EnvelopeScryptParams *params) {
        if (params->log2n < 10 || params->log2n > 22 || params->r < 1 || params->r > 32 || params->p < 1 ||
            params->p > 16)
                return -EINVAL;
        /* With these ranges the product is below 2^63, so it cannot overflow. */
        if (128 * (uint64_t) params->r * (UINT64_C(1) << params->log2n) * params->p > (UINT64_C(1) << 30))
                return -EINVAL;
        return 0;
}

/* Derives the KEK for the envelope whose header (bytes 0…67) is given. */
static int kek_derive(const EnvelopeCredential *credential, const uint8_t *header, uint8_t ret_kek[CRYPTO_KEY_LEN]) {
        const uint8_t *salt = header + ENVELOPE_SALT_OFFSET;

        if (credential->kdf == ENVELOPE_KDF_SCRYPT)
                return crypto_scrypt(credential->secret, credential->secret_len, salt, ENVELOPE_SALT_LEN,
                                     header[ENVELOPE_LOG2N_OFFSET], get_be32(header + ENVELOPE_R_OFFSET),
                                     get_be32(header + ENVELOPE_P_OFFSET), ret_kek, CRYPTO_KEY_LEN);

        const CryptoBuffer parts[] = {
                { keyfile_label, sizeof(keyfile_label) - 1 },
                { salt, ENVELOPE_SALT_LEN },
        };
        return crypto_hmac_sha256(credential->secret, credential->secret_len, parts, 2, ret_kek);
}

static int credential_check(const EnvelopeCredential *credential) {
        switch (credential->kdf) {
        case ENVELOPE_KDF_SCRYPT:
                return credential->secret || credential->secret_len == 0 ? 0 : -EINVAL;
        case ENVELOPE_KDF_KEYFILE:
                if (credential->secret_len < ENVELOPE_KEYFILE_MIN || credential->secret_len > ENVELOPE_KEYFILE_MAX) {
                        log_error("failed to use key file: it holds %zu bytes, not %d to %d",
                                  credential->secret_len, ENVELOPE_KEYFILE_MIN, ENVELOPE_KEYFILE_MAX);
                        return -EINVAL;
                }
                return 0;
        }
        return -EINVAL;
}

int envelope_wrap(const EnvelopeCredential *credential, const EnvelopeScryptParams *params,
                  const uint8_t uuid[ENVELOPE_UUID_LEN], const uint8_t parcel_key[ENVELOPE_KEY_LEN],
                  const uint8_t convergence_secret[ENVELOPE_KEY_LEN], uint8_t ret_envelope[ENVELOPE_LEN]) {
        static const EnvelopeScryptParams defaults = {
                ENVELOPE_SCRYPT_LOG2N_DEFAULT, ENVELOPE_SCRYPT_R_DEFAULT, ENVELOPE_SCRYPT_P_DEFAULT,
        };
        uint8_t e[ENVELOPE_LEN] = { 0 }, kek[CRYPTO_KEY_LEN], secrets[ENVELOPE_SECRETS_LEN];
        int r;

        r = credential_check(credential);
        if (r < 0)
                return r;
        if (credential->kdf == ENVELOPE_KDF_SCRYPT) {
                if (!params)
                        params = &defaults;
                r = envelope_scrypt_params_check(params);
                if (r < 0) {
                        log_error("failed to wrap key envelope: scrypt parameters log2N=%u r=%u p=%u out of range",
                                  params->log2n, params->r, params->p);
                        return r;
                }
        }

        memcpy(e, envelope_magic, sizeof(envelope_magic));
        e[4] = ENVELOPE_FORMAT_VERSION;
        e[5] = (uint8_t) credential->kdf;
        memcpy(e + ENVELOPE_UUID_OFFSET, uuid, ENVELOPE_UUID_LEN);
        r = crypto_random_bytes(e + ENVELOPE_SALT_OFFSET, ENVELOPE_SALT_LEN);
        if (r < 0)
                return r;
        if (credential->kdf == ENVELOPE_KDF_SCRYPT) {
                e[ENVELOPE_LOG2N_OFFSET] = (uint8_t) params->log2n;
                put_be32(e + ENVELOPE_R_OFFSET, params->r);
                put_be32(e + ENVELOPE_P_OFFSET, params->p);
        }

        r = kek_derive(credential, e, kek);
        if (r < 0)
                goto out_wipe;
        memcpy(secrets, parcel_key, ENVELOPE_KEY_LEN);
        memcpy(secrets + ENVELOPE_KEY_LEN, convergence_secret, ENVELOPE_KEY_LEN);
        r = crypto_aes256gcm_encrypt(kek, e, ENVELOPE_AAD_LEN, secrets, sizeof(secrets), e + ENVELOPE_AAD_LEN,
                                     e + ENVELOPE_TAG_OFFSET);
        if (r < 0)
                goto out_wipe;
        memcpy(ret_envelope, e, ENVELOPE_LEN);
out_wipe:
        crypto_wipe(kek, sizeof(kek));
        crypto_wipe(secrets, sizeof(secrets));
        return r;
}

/* Everything about the envelope that can be checked without the credential; -EBADMSG if damaged. */
static int header_check(const uint8_t *e, EnvelopeKdf expected_kdf) {
        if (memcmp(e, envelope_magic, sizeof(envelope_magic)) != 0 || e[4] != ENVELOPE_FORMAT_VERSION ||
            e[6] != 0 || e[7] != 0 || e[57] != 0 || e[58] != 0 || e[59] != 0) {
                log_debug("failed to unwrap key envelope: bad magic, version or reserved bytes");
                return -EBADMSG;
        }
        if (e[5] != ENVELOPE_KDF_SCRYPT && e[5] != ENVELOPE_KDF_KEYFILE) {
                log_debug("failed to unwrap key envelope: unknown kdf %u", e[5]);
                return -EBADMSG;
        }
        if (e[5] != expected_kdf) {
                log_debug("failed to unwrap key envelope: it needs a %s", e[5] == ENVELOPE_KDF_SCRYPT ? "passphrase" : "key file");
                return -EBADMSG;
        }
        if (e[5] == ENVELOPE_KDF_SCRYPT) {
                EnvelopeScryptParams params = {
                        e[ENVELOPE_LOG2N_OFFSET], get_be32(e + ENVELOPE_R_OFFSET), get_be32(e + ENVELOPE_P_OFFSET),
                };

                if (envelope_scrypt_params_check(&params) < 0) {
                        log_debug("failed to unwrap key envelope: scrypt parameters log2N=%u r=%u p=%u out of range",
                                  params.log2n, params.r, params.p);
                        return -EBADMSG;
                }
        } else if (e[ENVELOPE_LOG2N_OFFSET] != 0 || get_be32(e + ENVELOPE_R_OFFSET) != 0 ||
                   get_be32(e + ENVELOPE_P_OFFSET) != 0) {
                log_debug("failed to unwrap key envelope: scrypt parameters set for a key file");
                return -EBADMSG;
        }
        return 0;
}

int envelope_unwrap(const EnvelopeCredential *credential, const void *envelope, size_t envelope_len,
                    uint8_t ret_uuid[ENVELOPE_UUID_LEN], uint8_t ret_parcel_key[ENVELOPE_KEY_LEN],
                    uint8_t ret_convergence_secret[ENVELOPE_KEY_LEN]) {
        const uint8_t *e = envelope;
        uint8_t kek[CRYPTO_KEY_LEN], secrets[ENVELOPE_SECRETS_LEN];
        int r;

        r = credential_check(credential);
        if (r < 0)
                return r;
        if (envelope_len != ENVELOPE_LEN) {
                log_debug("failed to unwrap key envelope: %zu bytes, not %d", envelope_len, ENVELOPE_LEN);
                return -EBADMSG;
        }
        r = header_check(e, credential->kdf);
        if (r < 0)
                return r;

        r = kek_derive(credential, e, kek);
        if (r < 0)
                goto out_wipe;
        r = crypto_aes256gcm_decrypt(kek, e, ENVELOPE_AAD_LEN, e + ENVELOPE_AAD_LEN, ENVELOPE_SECRETS_LEN,
                                     e + ENVELOPE_TAG_OFFSET, secrets);
        if (r < 0) {
                log_debug("failed to unwrap key envelope: wrong passphrase or key file, or damaged envelope");
                goto out_wipe;
        }
        memcpy(ret_uuid, e + ENVELOPE_UUID_OFFSET, ENVELOPE_UUID_LEN);
        memcpy(ret_parcel_key, secrets, ENVELOPE_KEY_LEN);
        memcpy(ret_convergence_secret, secrets + ENVELOPE_KEY_LEN, ENVELOPE_KEY_LEN);
out_wipe:
        crypto_wipe(kek, sizeof(kek));
        crypto_wipe(secrets, sizeof(secrets));
        return r;
}
