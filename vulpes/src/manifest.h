/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MANIFEST_PARCEL_KEY_LEN 32
#define MANIFEST_DIGEST_LEN 32
#define MANIFEST_UUID_STRING_LEN 36

/* The largest manifest payload this implementation opens. */
#define MANIFEST_PAYLOAD_MAX ((uint64_t) 64 << 20)

typedef enum ManifestImageId {
        MANIFEST_IMAGE_DISK,
        MANIFEST_IMAGE_MEMORY,
        _MANIFEST_IMAGE_MAX,
} ManifestImageId;

/* One entry of "images": the image's size, the digest and length of its keyring stream, and its chunk size
 * (its own "chunk_size" if it has one, else the manifest's). */
typedef struct ManifestImage {
        uint64_t size;
        uint8_t keyring_sha256[MANIFEST_DIGEST_LEN];
        uint64_t keyring_size;
        uint64_t chunks;
        uint32_t chunk_size;
} ManifestImage;

/* One entry of "blobs": a sealed blob of this version and its kind, payload SHA-256 and payload size. */
typedef struct ManifestBlob {
        unsigned kind;
        uint8_t sha256[MANIFEST_DIGEST_LEN];
        uint64_t size;
} ManifestBlob;

typedef struct Manifest Manifest;

/*
 * Opens a sealed manifest (kind 1) and parses it for the given parcel (canonical UUID string) and
 * version.  Returns -EINVAL if parcel is not a UUID string, and -EBADMSG if the blob does not open, is
 * not UTF-8 JSON (duplicate keys included), has a format other than 1, is for another parcel or version,
 * or breaks any rule of the format's manifest table (the same rules parcels/manifest.py enforces).
 * Unknown keys are ignored.
 */
int manifest_open(const uint8_t parcel_key[MANIFEST_PARCEL_KEY_LEN], const void *blob, size_t blob_len,
                  const char *parcel, uint64_t version, Manifest **ret);

/* The same checks on an already opened JSON payload. */
int manifest_parse(const char *json, size_t len, const char *parcel, uint64_t version, Manifest **ret);

Manifest *manifest_free(Manifest *m);

const char *manifest_parcel(const Manifest *m);
const char *manifest_name(const Manifest *m);
uint64_t manifest_version(const Manifest *m);
uint32_t manifest_chunk_size(const Manifest *m);
const ManifestImage *manifest_image(const Manifest *m, ManifestImageId id);
const char *manifest_image_name(ManifestImageId id);
uint64_t manifest_ram_mib(const Manifest *m);
bool manifest_suspended(const Manifest *m);

/* The chunk indices of an image in the order the guest first touched them; *ret_n may be 0. */
void manifest_working_set(const Manifest *m, ManifestImageId id, const uint64_t **ret_indices, size_t *ret_n);

/* Looks up a blob by name: 0, or -ENOENT if the manifest names no such blob. */
int manifest_blob(const Manifest *m, const char *name, ManifestBlob *ret);

/* vm fields; manifest_qemu_version() returns NULL when absent or null. */
const char *manifest_machine(const Manifest *m);
uint64_t manifest_smp(const Manifest *m);
const char *manifest_qemu_version(const Manifest *m);
