/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define ENVELOPE_LEN 148
#define ENVELOPE_UUID_LEN 16
#define ENVELOPE_KEY_LEN 32         /* the parcel key and the convergence secret */

#define ENVELOPE_KEYFILE_MIN 32
#define ENVELOPE_KEYFILE_MAX 4096

/* The scrypt parameters writers use unless told otherwise. */
#define ENVELOPE_SCRYPT_LOG2N_DEFAULT 15u
#define ENVELOPE_SCRYPT_R_DEFAULT 8u
#define ENVELOPE_SCRYPT_P_DEFAULT 1u

typedef enum EnvelopeKdf {
        ENVELOPE_KDF_SCRYPT = 1,    /* secret is a passphrase (UTF-8 bytes) */
        ENVELOPE_KDF_KEYFILE = 2,   /* secret is the contents of a key file */
} EnvelopeKdf;

/* What the user unlocks an envelope with. */
typedef struct EnvelopeCredential {
        EnvelopeKdf kdf;
        const void *secret;
        size_t secret_len;
} EnvelopeCredential;

typedef struct EnvelopeScryptParams {
        unsigned log2n;
        uint32_t r;
        uint32_t p;
} EnvelopeScryptParams;

/* -EINVAL unless log2n is 10…22, r 1…32, p 1…16 and 128·r·N·p at most 1 GiB. */
int envelope_scrypt_params_check(const EnvelopeScryptParams *params);

/*
 * Wraps the parcel key and convergence secret of one parcel with a fresh salt.  params is used for
 * ENVELOPE_KDF_SCRYPT only; NULL means the defaults.
 */
int envelope_wrap(const EnvelopeCredential *credential, const EnvelopeScryptParams *params,
                  const uint8_t uuid[ENVELOPE_UUID_LEN], const uint8_t parcel_key[ENVELOPE_KEY_LEN],
                  const uint8_t convergence_secret[ENVELOPE_KEY_LEN], uint8_t ret_envelope[ENVELOPE_LEN]);

/*
 * Unwraps an envelope.  A wrong passphrase or key file and a damaged envelope give the same error,
 * -EBADMSG, as the format requires; scrypt parameters are validated before scrypt runs.  The caller must
 * check the returned UUID against the parcel it asked for.
 */
int envelope_unwrap(const EnvelopeCredential *credential, const void *envelope, size_t envelope_len,
                    uint8_t ret_uuid[ENVELOPE_UUID_LEN], uint8_t ret_parcel_key[ENVELOPE_KEY_LEN],
                    uint8_t ret_convergence_secret[ENVELOPE_KEY_LEN]);
