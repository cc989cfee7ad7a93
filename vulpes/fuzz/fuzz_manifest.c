/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Manifests (manifest.c, through jansson).  Input: a mode byte, the version asked for, then the mode's
 * bytes, for the parcel FUZZ_PARCEL:
 *   even  the JSON payload of an opened manifest (manifest_parse);
 *   odd   the same JSON, sealed by the harness as a kind-1 blob and opened with manifest_open.
 * An accepted manifest must answer every accessor with what the format allows: a valid chunk size,
 * working-set indices inside their image, blob kinds 3 or 4, a versioned machine type.
 */
#include <errno.h>

#include "chunk.h"
#include "fuzz.h"
#include "manifest.h"
#include "seal.h"

#define FUZZ_PARCEL "4e653b57-acae-4766-9bfe-71f70decf1a5"

static void check_accepted(const Manifest *m, uint64_t version) {
        static const char *const blob_names[] = { "devstate", "kernel", "initrd", "resumepack", "manifest", "x" };
        ManifestBlob blob;

        FUZZ_CHECK(strcmp(manifest_parcel(m), FUZZ_PARCEL) == 0, "the manifest is for another parcel");
        FUZZ_CHECK(manifest_version(m) == version, "the manifest is for another version");
        FUZZ_CHECK(chunk_size_valid(manifest_chunk_size(m)), "the manifest has an invalid chunk size");
        FUZZ_CHECK(manifest_name(m) && *manifest_name(m), "the manifest has no name");
        FUZZ_CHECK(manifest_machine(m) && strchr(manifest_machine(m), '-'), "the manifest has no machine type");
        FUZZ_CHECK(manifest_smp(m) >= 1 && manifest_ram_mib(m) >= 1, "the manifest has no CPU or RAM");
        FUZZ_CHECK(!manifest_suspended(m) || manifest_qemu_version(m), "a suspended manifest has no QEMU version");
        for (ManifestImageId id = 0; id < _MANIFEST_IMAGE_MAX; id++) {
                const ManifestImage *image = manifest_image(m, id);
                uint64_t limit = chunk_count(image->size, image->chunk_size);
                const uint64_t *indices;
                size_t n;

                FUZZ_CHECK(chunk_size_valid(image->chunk_size), "an image has an invalid chunk size");
                FUZZ_CHECK(image->chunks <= limit, "an image has more chunks than fit");
                FUZZ_CHECK(image->keyring_size == 28 + 81 * image->chunks, "a keyring size is wrong");
                manifest_working_set(m, id, &indices, &n);
                for (size_t i = 0; i < n; i++)
                        FUZZ_CHECK(indices[i] < limit, "a working-set index is outside its image");
        }
        for (size_t i = 0; i < sizeof(blob_names) / sizeof(blob_names[0]); i++) {
                int r = manifest_blob(m, blob_names[i], &blob);

                FUZZ_CHECK(r == 0 || r == -ENOENT, "manifest_blob returned neither 0 nor -ENOENT");
                FUZZ_CHECK(r < 0 || blob.kind == 3 || blob.kind == 4, "a blob has a kind other than 3 or 4");
        }
        if (manifest_suspended(m))
                FUZZ_CHECK(manifest_blob(m, "devstate", &blob) == 0 && blob.kind == 3,
                           "a suspended manifest has no device state");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        Manifest *m = NULL;
        uint8_t *blob;
        size_t blob_len;
        uint64_t version;
        int r;

        if (size < 2)
                return 0;
        version = data[1] ? data[1] : 1;
        if (data[0] % 2 == 0) {
                r = manifest_parse((const char *) data + 2, size - 2, FUZZ_PARCEL, version, &m);
        } else {
                FUZZ_CHECK(seal_blob(fuzz_key, SEAL_KIND_MANIFEST, data + 2, size - 2, 3, &blob, &blob_len) == 0,
                           "seal_blob failed");
                r = manifest_open(fuzz_key, blob, blob_len, FUZZ_PARCEL, version, &m);
                free(blob);
        }
        FUZZ_CHECK(r == 0 || r == -EBADMSG, "the manifest reader returned neither 0 nor -EBADMSG");
        if (r == 0)
                check_accepted(m, version);
        manifest_free(m);
        return 0;
}
