/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The cryptographic primitives of the parcel format, and the only file that includes OpenSSL:
 * SHA-256, HMAC-SHA256, AES-256-GCM with a zero nonce, AES-256 key wrap (RFC 3394), scrypt,
 * random bytes and wiping.
 *
 * Threading: every function is safe to call from any thread.  The algorithms are fetched once
 * (pthread_once) and shared; each call uses its own OpenSSL context.  A CryptoSha256 belongs to one
 * thread at a time.
 */
#include "crypto.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "log.h"

/* OpenSSL takes int lengths; longer buffers are fed in pieces of this size. */
#define PIECE_MAX ((size_t) 1 << 30)

struct CryptoSha256 {
        EVP_MD_CTX *ctx;
};

static const uint8_t zero_nonce[12];

/*
 * Algorithms are fetched once and shared.  OpenSSL 3 otherwise looks the name up in its provider store
 * (under a lock) for every context set up with EVP_sha256() and the like: a few percent of the CPU time
 * of a warm-cache read, which sets up three contexts per chunk.  If a fetch fails, the call falls back to
 * the implicit fetch (and reports its error there).
 */
static EVP_MAC *hmac_algorithm;
static EVP_MD *sha256_algorithm;
static EVP_CIPHER *gcm_algorithm, *keywrap_algorithm;
static pthread_once_t fetch_once = PTHREAD_ONCE_INIT;

static void algorithms_fetch(void) {
        hmac_algorithm = EVP_MAC_fetch(NULL, OSSL_MAC_NAME_HMAC, NULL);
        sha256_algorithm = EVP_MD_fetch(NULL, OSSL_DIGEST_NAME_SHA2_256, NULL);
        gcm_algorithm = EVP_CIPHER_fetch(NULL, "AES-256-GCM", NULL);
        keywrap_algorithm = EVP_CIPHER_fetch(NULL, "AES-256-WRAP", NULL);
        ERR_clear_error();
}

static const EVP_MD *sha256_get(void) {
        pthread_once(&fetch_once, algorithms_fetch);
        return sha256_algorithm ? sha256_algorithm : EVP_sha256();
}

static const EVP_CIPHER *gcm_get(void) {
        pthread_once(&fetch_once, algorithms_fetch);
        return gcm_algorithm ? gcm_algorithm : EVP_aes_256_gcm();
}

static const EVP_CIPHER *keywrap_get(void) {
        pthread_once(&fetch_once, algorithms_fetch);
        return keywrap_algorithm ? keywrap_algorithm : EVP_aes_256_wrap();
}

/* Logs the reason OpenSSL recorded for a failure it reported, and empties its error queue. */
static int log_openssl_failure(const char *what) {
        unsigned long code = ERR_get_error();
        char reason[256] = "unknown OpenSSL error";

        if (code != 0)
                ERR_error_string_n(code, reason, sizeof(reason));
        ERR_clear_error();
        log_error("failed to %s: %s", what, reason);
        return -EIO;
}

int crypto_sha256(const void *data, size_t len, uint8_t ret_digest[CRYPTO_SHA256_LEN]) {
        CryptoSha256 *s = NULL;
        int r;

        r = crypto_sha256_new(&s);
        if (r < 0)
                return r;
        r = crypto_sha256_update(s, data, len);
        if (r < 0)
                goto out_free;
        r = crypto_sha256_final(s, ret_digest);
out_free:
        crypto_sha256_free(s);
        return r;
}

int crypto_sha256_new(CryptoSha256 **ret) {
        CryptoSha256 *s;
        int r;

        s = calloc(1, sizeof(*s));
        if (!s)
                return -ENOMEM;
        s->ctx = EVP_MD_CTX_new();
        if (!s->ctx) {
                r = -ENOMEM;
                goto out_free;
        }
        if (EVP_DigestInit_ex(s->ctx, sha256_get(), NULL) != 1) {
                r = log_openssl_failure("initialize SHA-256");
                goto out_free;
        }
        *ret = s;
        return 0;

out_free:
        crypto_sha256_free(s);
        return r;
}

int crypto_sha256_update(CryptoSha256 *s, const void *data, size_t len) {
        if (len > 0 && EVP_DigestUpdate(s->ctx, data, len) != 1)
                return log_openssl_failure("update SHA-256");
        return 0;
}

int crypto_sha256_final(CryptoSha256 *s, uint8_t ret_digest[CRYPTO_SHA256_LEN]) {
        unsigned int out_len = 0;

        if (EVP_DigestFinal_ex(s->ctx, ret_digest, &out_len) != 1 || out_len != CRYPTO_SHA256_LEN)
                return log_openssl_failure("finish SHA-256");
        return 0;
}

CryptoSha256 *crypto_sha256_free(CryptoSha256 *s) {
        if (!s)
                return NULL;
        EVP_MD_CTX_free(s->ctx);
        free(s);
        return NULL;
}

int crypto_hmac_sha256(const void *key, size_t key_len, const CryptoBuffer *parts, size_t n_parts,
                       uint8_t ret_mac[CRYPTO_SHA256_LEN]) {
        char digest_name[] = OSSL_DIGEST_NAME_SHA2_256;
        OSSL_PARAM params[] = {
                OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest_name, 0),
                OSSL_PARAM_construct_end(),
        };
        EVP_MAC_CTX *ctx;
        size_t out_len = 0;
        int r = 0;

        pthread_once(&fetch_once, algorithms_fetch);
        if (!hmac_algorithm)
                return log_openssl_failure("fetch HMAC");

        ctx = EVP_MAC_CTX_new(hmac_algorithm);
        if (!ctx)
                return -ENOMEM;
        if (EVP_MAC_init(ctx, key, key_len, params) != 1) {
                r = log_openssl_failure("initialize HMAC-SHA256");
                goto out_ctx;
        }
        for (size_t i = 0; i < n_parts; i++)
                if (parts[i].len > 0 && EVP_MAC_update(ctx, parts[i].data, parts[i].len) != 1) {
                        r = log_openssl_failure("update HMAC-SHA256");
                        goto out_ctx;
                }
        if (EVP_MAC_final(ctx, ret_mac, &out_len, CRYPTO_SHA256_LEN) != 1 || out_len != CRYPTO_SHA256_LEN)
                r = log_openssl_failure("finish HMAC-SHA256");
out_ctx:
        EVP_MAC_CTX_free(ctx);
        return r;
}

/* Feeds in[0..len) through ctx in int-sized pieces; in == NULL means additional authenticated data. */
static int cipher_update(EVP_CIPHER_CTX *ctx, int encrypt, uint8_t *out, const uint8_t *in, size_t len) {
        while (len > 0) {
                int piece = (int) (len < PIECE_MAX ? len : PIECE_MAX), out_len = 0;
                int ok = encrypt ? EVP_EncryptUpdate(ctx, out, &out_len, in, piece)
                                 : EVP_DecryptUpdate(ctx, out, &out_len, in, piece);

                if (ok != 1 || (out && out_len != piece))
                        return -EIO;
                in += piece;
                if (out)
                        out += piece;
                len -= (size_t) piece;
        }
        return 0;
}

int crypto_aes256gcm_encrypt(const uint8_t key[CRYPTO_KEY_LEN], const void *aad, size_t aad_len,
                             const void *in, size_t len, void *ret_out, uint8_t ret_tag[CRYPTO_GCM_TAG_LEN]) {
        EVP_CIPHER_CTX *ctx;
        int out_len = 0, r = 0;

        ctx = EVP_CIPHER_CTX_new();
        if (!ctx)
                return -ENOMEM;
        if (EVP_EncryptInit_ex(ctx, gcm_get(), NULL, key, zero_nonce) != 1 ||
            cipher_update(ctx, 1, NULL, aad, aad_len) < 0 ||
            cipher_update(ctx, 1, ret_out, in, len) < 0 ||
            EVP_EncryptFinal_ex(ctx, NULL, &out_len) != 1 ||
            EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, CRYPTO_GCM_TAG_LEN, ret_tag) != 1)
                r = log_openssl_failure("encrypt with AES-256-GCM");
        EVP_CIPHER_CTX_free(ctx);
        return r;
}

int crypto_aes256gcm_decrypt(const uint8_t key[CRYPTO_KEY_LEN], const void *aad, size_t aad_len,
                             const void *in, size_t len, const uint8_t tag[CRYPTO_GCM_TAG_LEN], void *ret_out) {
        uint8_t tag_copy[CRYPTO_GCM_TAG_LEN];
        EVP_CIPHER_CTX *ctx;
        int out_len = 0, r = 0;

        memcpy(tag_copy, tag, sizeof(tag_copy));
        ctx = EVP_CIPHER_CTX_new();
        if (!ctx)
                return -ENOMEM;
        if (EVP_DecryptInit_ex(ctx, gcm_get(), NULL, key, zero_nonce) != 1 ||
            cipher_update(ctx, 0, NULL, aad, aad_len) < 0 ||
            cipher_update(ctx, 0, ret_out, in, len) < 0 ||
            EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, CRYPTO_GCM_TAG_LEN, tag_copy) != 1) {
                r = log_openssl_failure("decrypt with AES-256-GCM");
                goto out_wipe;
        }
        if (EVP_DecryptFinal_ex(ctx, NULL, &out_len) != 1) {
                /* Authentication failure: the caller decides what it means. */
                ERR_clear_error();
                r = -EBADMSG;
                goto out_wipe;
        }
        goto out_ctx;

out_wipe:
        crypto_wipe(ret_out, len);
out_ctx:
        EVP_CIPHER_CTX_free(ctx);
        return r;
}

static int keywrap_run(int encrypt, const uint8_t kek[CRYPTO_KEY_LEN], const void *in, size_t in_len,
                       void *ret_out, size_t out_len) {
        EVP_CIPHER_CTX *ctx;
        int n = 0, final_len = 0, r = 0;

        if (in_len > 4096)
                return -EINVAL;
        ctx = EVP_CIPHER_CTX_new();
        if (!ctx)
                return -ENOMEM;
        EVP_CIPHER_CTX_set_flags(ctx, EVP_CIPHER_CTX_FLAG_WRAP_ALLOW);
        if (EVP_CipherInit_ex(ctx, keywrap_get(), NULL, kek, NULL, encrypt) != 1) {
                r = log_openssl_failure("initialize AES key wrap");
                goto out_ctx;
        }
        if (EVP_CipherUpdate(ctx, ret_out, &n, in, (int) in_len) != 1 || n != (int) out_len ||
            EVP_CipherFinal_ex(ctx, (uint8_t *) ret_out + n, &final_len) != 1 || final_len != 0) {
                if (encrypt) {
                        r = log_openssl_failure("wrap key");
                } else {
                        /* The RFC 3394 integrity check failed: altered, or wrapped under another key. */
                        ERR_clear_error();
                        crypto_wipe(ret_out, out_len);
                        r = -EBADMSG;
                }
        }
out_ctx:
        EVP_CIPHER_CTX_free(ctx);
        return r;
}

int crypto_aes256_keywrap(const uint8_t kek[CRYPTO_KEY_LEN], const void *in, size_t len, void *ret_out) {
        if (len < 16 || len % 8 != 0)
                return -EINVAL;
        return keywrap_run(1, kek, in, len, ret_out, len + CRYPTO_KEYWRAP_OVERHEAD);
}

int crypto_aes256_keyunwrap(const uint8_t kek[CRYPTO_KEY_LEN], const void *in, size_t wrapped_len, void *ret_out) {
        if (wrapped_len < 24 || wrapped_len % 8 != 0)
                return -EINVAL;
        return keywrap_run(0, kek, in, wrapped_len, ret_out, wrapped_len - CRYPTO_KEYWRAP_OVERHEAD);
}

int crypto_scrypt(const void *password, size_t password_len, const void *salt, size_t salt_len,
                  unsigned log2n, uint32_t r, uint32_t p, void *ret_key, size_t key_len) {
        uint64_t n, maxmem;

        if (log2n < 1 || log2n > 40 || r == 0 || p == 0 || r > (1u << 20) || p > (1u << 20))
                return -EINVAL;
        n = UINT64_C(1) << log2n;
        /* What OpenSSL allocates: 128·r·(N + 2) for V plus 128·r·p for B; a little slack on top. */
        maxmem = 128 * (uint64_t) r * (n + 2) + 128 * (uint64_t) r * p + (UINT64_C(1) << 16);

        if (EVP_PBE_scrypt(password_len ? password : "", password_len, salt, salt_len, n, r, p, maxmem,
                           ret_key, key_len) != 1)
                return log_openssl_failure("derive key with scrypt");
        return 0;
}

int crypto_random_bytes(void *ret_buf, size_t len) {
        uint8_t *p = ret_buf;

        while (len > 0) {
                int piece = (int) (len < PIECE_MAX ? len : PIECE_MAX);

                if (RAND_bytes(p, piece) != 1)
                        return log_openssl_failure("generate random bytes");
                p += piece;
                len -= (size_t) piece;
        }
        return 0;
}

void crypto_wipe(void *buf, size_t len) {
        if (buf && len > 0)
                OPENSSL_cleanse(buf, len);
}
