/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define CRYPTO_SHA256_LEN 32
#define CRYPTO_KEY_LEN 32          /* AES-256 and HMAC-SHA256 keys */
#define CRYPTO_GCM_TAG_LEN 16
#define CRYPTO_KEYWRAP_OVERHEAD 8  /* RFC 3394 integrity block */

/* One piece of a message given to crypto_hmac_sha256(). */
typedef struct CryptoBuffer {
        const void *data;
        size_t len;
} CryptoBuffer;

typedef struct CryptoSha256 CryptoSha256;

int crypto_sha256(const void *data, size_t len, uint8_t ret_digest[CRYPTO_SHA256_LEN]);

int crypto_sha256_new(CryptoSha256 **ret);
int crypto_sha256_update(CryptoSha256 *s, const void *data, size_t len);
/* Finishes the digest; the context must not be updated afterwards. */
int crypto_sha256_final(CryptoSha256 *s, uint8_t ret_digest[CRYPTO_SHA256_LEN]);
CryptoSha256 *crypto_sha256_free(CryptoSha256 *s);

/* HMAC-SHA256 over the concatenation of n_parts buffers. */
int crypto_hmac_sha256(const void *key, size_t key_len, const CryptoBuffer *parts, size_t n_parts,
                       uint8_t ret_mac[CRYPTO_SHA256_LEN]);

/*
 * AES-256-GCM with the all-zero 96-bit nonce: every key in the parcel format encrypts one plaintext only.
 * out may equal in.  Decryption returns -EBADMSG when the tag does not verify and then zeroes out[].
 */
int crypto_aes256gcm_encrypt(const uint8_t key[CRYPTO_KEY_LEN], const void *aad, size_t aad_len,
                             const void *in, size_t len, void *ret_out, uint8_t ret_tag[CRYPTO_GCM_TAG_LEN]);
int crypto_aes256gcm_decrypt(const uint8_t key[CRYPTO_KEY_LEN], const void *aad, size_t aad_len,
                             const void *in, size_t len, const uint8_t tag[CRYPTO_GCM_TAG_LEN], void *ret_out);

/*
 * AES-256 key wrap (RFC 3394, default IV).  len is the key data length: a multiple of 8, at least 16;
 * the wrapped form is len + 8 bytes.  Unwrapping returns -EBADMSG when the integrity check fails.
 */
int crypto_aes256_keywrap(const uint8_t kek[CRYPTO_KEY_LEN], const void *in, size_t len, void *ret_out);
int crypto_aes256_keyunwrap(const uint8_t kek[CRYPTO_KEY_LEN], const void *in, size_t wrapped_len, void *ret_out);

/*
 * scrypt with N = 2^log2n.  The caller validates the parameters; the memory limit handed to OpenSSL is
 * derived from them (OpenSSL's default of 32 MB is below what N = 2^15, r = 8 needs).
 */
int crypto_scrypt(const void *password, size_t password_len, const void *salt, size_t salt_len,
                  unsigned log2n, uint32_t r, uint32_t p, void *ret_key, size_t key_len);

int crypto_random_bytes(void *ret_buf, size_t len);

/* Overwrites len bytes in a way the compiler does not remove. NULL-safe. */
void crypto_wipe(void *buf, size_t len);
