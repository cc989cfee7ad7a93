/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CHUNK_SIZE_MIN 4096u
#define CHUNK_SIZE_MAX 4194304u
#define CHUNK_SIZE_DEFAULT 131072u

#define CHUNK_HEADER_LEN 12
#define CHUNK_OVERHEAD 28           /* header and GCM tag */
#define CHUNK_TAG_LEN 32
#define CHUNK_KEY_LEN 32
#define CHUNK_SECRET_LEN 32

#define CHUNK_FLAG_ZSTD 0x01u       /* keyring flag bit 0: the object body is zstd-compressed */

/* A power of two between CHUNK_SIZE_MIN and CHUNK_SIZE_MAX. */
bool chunk_size_valid(uint64_t chunk_size);

/* ceil(image_size / chunk_size); chunk_size must be valid. */
uint64_t chunk_count(uint64_t image_size, uint32_t chunk_size);

/* The plaintext length of chunk idx (only the last may be short); 0 if idx is past the image's end. */
size_t chunk_length(uint64_t image_size, uint32_t chunk_size, uint64_t idx);

/* True if all len bytes are zero: such chunks are never stored and have no keyring record. */
bool chunk_is_zero(const void *data, size_t len);

/* The largest object chunk_encode() writes for an n-byte plaintext. */
static inline size_t chunk_object_max_len(size_t n) {
        return n + CHUNK_OVERHEAD;
}

/*
 * Encodes an n-byte plaintext (1 ≤ n ≤ CHUNK_SIZE_MAX) into a chunk object at ret_object, which must
 * hold chunk_object_max_len(n) bytes, compressing at zstd level `level`.  Returns the object's length in
 * *ret_object_len, its tag, its convergent key and its keyring flags.
 */
int chunk_encode(const void *plaintext, size_t n, const uint8_t secret[CHUNK_SECRET_LEN], int level,
                 void *ret_object, size_t *ret_object_len, uint8_t ret_tag[CHUNK_TAG_LEN],
                 uint8_t ret_key[CHUNK_KEY_LEN], uint8_t *ret_flags);

/* Checks that SHA-256(object) equals tag: -EBADMSG if not. */
int chunk_verify_tag(const void *object, size_t object_len, const uint8_t tag[CHUNK_TAG_LEN]);

/*
 * Decodes a chunk object into exactly n bytes at ret_plaintext after every check of the format, in its
 * order: tag, header, plaintext length, GCM, body length or zstd frame.  Returns -EBADMSG at the first
 * failure, and then ret_plaintext[] holds zeros, never partial plaintext.
 */
int chunk_decode(const void *object, size_t object_len, const uint8_t tag[CHUNK_TAG_LEN],
                 const uint8_t key[CHUNK_KEY_LEN], size_t n, void *ret_plaintext);

/*
 * chunk_decode() without check 1, for a caller that has just verified these exact bytes with
 * chunk_verify_tag() (a cache tier verifies once, then decodes): hashing a chunk twice costs as much as
 * decrypting it.
 */
int chunk_decode_verified(const void *object, size_t object_len, const uint8_t key[CHUNK_KEY_LEN], size_t n,
                          void *ret_plaintext);
