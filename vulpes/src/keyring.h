/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KEYRING_STREAM_HEADER_LEN 28
#define KEYRING_RECORD_LEN 81
#define KEYRING_TAG_LEN 32
#define KEYRING_KEY_LEN 32
#define KEYRING_WKEY_LEN 40
#define KEYRING_PARCEL_KEY_LEN 32
#define KEYRING_DIGEST_LEN 32

#define KEYRING_FLAG_ZSTD 0x01u
#define KEYRING_FLAGS_VALID 0x01u    /* bits 1–7 must be 0 */

/* sqlite stores 64-bit signed integers: image sizes and indices above this cannot be kept locally. */
#define KEYRING_IMAGE_SIZE_MAX ((uint64_t) INT64_MAX)

/* One chunk of an image: index, keyring flags, tag and wrapped chunk key. */
typedef struct KeyringRecord {
        uint64_t idx;
        uint8_t flags;
        uint8_t tag[KEYRING_TAG_LEN];
        uint8_t wkey[KEYRING_WKEY_LEN];
} KeyringRecord;

/* --- chunk keys ------------------------------------------------------------------------------------ */

/* AES-KW with KW = HMAC(PK, "isr-keywrap-v1").  Unwrapping returns -EBADMSG for an altered wrapped key
 * or one wrapped under another parcel key. */
int keyring_wrap_key(const uint8_t parcel_key[KEYRING_PARCEL_KEY_LEN], const uint8_t key[KEYRING_KEY_LEN],
                     uint8_t ret_wkey[KEYRING_WKEY_LEN]);
int keyring_unwrap_key(const uint8_t parcel_key[KEYRING_PARCEL_KEY_LEN], const uint8_t wkey[KEYRING_WKEY_LEN],
                       uint8_t ret_key[KEYRING_KEY_LEN]);

/* KW itself, for a caller that unwraps many keys under one parcel key: keyring_unwrap_key_with() skips the
 * HMAC that keyring_unwrap_key() computes each time.  KW is as secret as the parcel key. */
int keyring_kw_derive(const uint8_t parcel_key[KEYRING_PARCEL_KEY_LEN], uint8_t ret_kw[KEYRING_KEY_LEN]);
int keyring_unwrap_key_with(const uint8_t kw[KEYRING_KEY_LEN], const uint8_t wkey[KEYRING_WKEY_LEN],
                            uint8_t ret_key[KEYRING_KEY_LEN]);

/* --- keyring streams ------------------------------------------------------------------------------- */

/* Serializes records (strictly increasing, in range, valid flags; else -EINVAL) into a malloc()ed stream. */
int keyring_stream_encode(uint32_t chunk_size, uint64_t image_size, const KeyringRecord *records, size_t n_records,
                          uint8_t **ret_stream, size_t *ret_len);

/*
 * Parses a stream with every check of the format: exact length, magic, version, reserved bytes, chunk
 * size, strictly increasing in-range indices, reserved flag bits.  -EBADMSG at the first failure.  The
 * records array is malloc()ed (NULL when there are none).
 */
int keyring_stream_decode(const void *stream, size_t len, uint32_t *ret_chunk_size, uint64_t *ret_image_size,
                          KeyringRecord **ret_records, size_t *ret_n_records);

/* --- the local keyring database -------------------------------------------------------------------- */

typedef struct Keyring Keyring;
typedef struct KeyringIterator KeyringIterator;

/* Creates a keyring database with the format's schema; -EEXIST if path already holds one. */
int keyring_create(const char *path, uint32_t chunk_size, uint64_t image_size, Keyring **ret);

/* Opens an existing keyring database after checking application_id, user_version and meta. */
int keyring_open(const char *path, Keyring **ret);

Keyring *keyring_free(Keyring *k);

uint32_t keyring_chunk_size(const Keyring *k);
uint64_t keyring_image_size(const Keyring *k);

/* Returns -ENOENT if idx has no record (the chunk is all zeros), -EBADMSG if the stored record is invalid. */
int keyring_get(Keyring *k, uint64_t idx, KeyringRecord *ret);

/* Inserts or replaces one record; -EINVAL if its index is out of range or its flags invalid. */
int keyring_put(Keyring *k, const KeyringRecord *record);

/* Removes the record of idx: returns 1 if there was one, 0 if not. */
int keyring_delete(Keyring *k, uint64_t idx);

/* Number of records. */
int keyring_count(Keyring *k, uint64_t *ret_count);

/*
 * Iterates over the records in index order.  keyring_iterator_next() returns 1 and a record, 0 at the
 * end, or a negative errno.  The keyring must not be modified while an iterator is open.
 */
int keyring_iterator_new(Keyring *k, KeyringIterator **ret);
int keyring_iterator_next(KeyringIterator *it, KeyringRecord *ret);
KeyringIterator *keyring_iterator_free(KeyringIterator *it);

/*
 * Replaces the whole keyring (meta and records) with a validated stream, in one transaction: a stream
 * that fails validation changes nothing.
 */
int keyring_import_stream(Keyring *k, const void *stream, size_t len);

/* Produces the canonical stream from the records ordered by index; malloc()ed. */
int keyring_export_stream(Keyring *k, uint8_t **ret_stream, size_t *ret_len);

/* SHA-256 of the stream keyring_export_stream() would produce, and its length, without building it. */
int keyring_digest(Keyring *k, uint8_t ret_digest[KEYRING_DIGEST_LEN], uint64_t *ret_stream_len);

/* --- vulpes's own tables in the local keyring ------------------------------------------------------ */

/*
 * vulpes keeps two tables of its own next to the format's (which it never changes in shape):
 * vulpes_changed(idx), the chunks written since the base version, and vulpes_uploads(tag), the objects it
 * made that the server may not have yet.
 */

/* One record change of a flush: the new record, or the removal of idx (the chunk became all zeros). */
typedef struct KeyringChange {
        bool remove;
        KeyringRecord record;          /* record.idx is the index in both cases */
} KeyringChange;

/* Creates vulpes's tables if they are missing. */
int keyring_state_init(Keyring *k);

/* Applies changes in one transaction (durable when it returns), noting the indices as changed and the new
 * tags as to be uploaded. */
int keyring_apply(Keyring *k, const KeyringChange *changes, size_t n);

/*
 * Up to max tags still to upload that some record still names (tags no record names any more are
 * forgotten first).  *ret_n may be 0: nothing to upload.
 */
int keyring_uploads_next(Keyring *k, uint8_t (*ret_tags)[KEYRING_TAG_LEN], size_t max, size_t *ret_n);

/* The server has these objects (or nobody needs them): forgets them in one transaction, so that a batch of
 * uploads costs one durable commit. */
int keyring_uploads_done(Keyring *k, const uint8_t (*tags)[KEYRING_TAG_LEN], size_t n);

int keyring_state_counts(Keyring *k, uint64_t *ret_changed, uint64_t *ret_uploads);

/* After a checkin made the current keyring the base version: nothing has changed since. */
int keyring_changed_reset(Keyring *k);
