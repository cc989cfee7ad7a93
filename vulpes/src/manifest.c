/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Manifests (doc/parcel-format.md, "Manifest"): opens the sealed JSON description of a version, checks
 * every rule of the format's manifest table and exposes what vulpes needs.  The only file that includes
 * jansson.
 *
 * The rules are those parcels/manifest.py enforces, including what the table implies (keyring.size is
 * 28 + 81·chunks, blob kinds are 3 or 4, boot names refer to boot blobs, a suspended version has a device
 * state, working-set indices are in range and unique), so a manifest either side accepts the other
 * accepts too; the shared test vectors pin this.  Unknown keys are ignored, duplicate keys refused.
 * Integers above 2^63 − 1 are beyond jansson and refused.
 *
 * Threading: a Manifest is immutable after opening and may be read from any thread.
 */
#include "manifest.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "chunk.h"
#include "hex.h"
#include "log.h"
#include "seal.h"

enum {
        MANIFEST_FORMAT = 1,
        MANIFEST_NAME_MAX = 64,
        BLOB_NAME_MAX = 64,
        KEYRING_HEADER_LEN = 28,
        KEYRING_RECORD_LEN = 81,
        BLOB_KIND_DEVICE_STATE = 3,
        BLOB_KIND_BOOT_FILE = 4,
};

struct Manifest {
        json_t *root;                       /* validated; the accessors read from it */
        char parcel[MANIFEST_UUID_STRING_LEN + 1];
        uint64_t version;
        uint32_t chunk_size;
        ManifestImage images[_MANIFEST_IMAGE_MAX];
        uint64_t *working_set[_MANIFEST_IMAGE_MAX];
        size_t working_set_len[_MANIFEST_IMAGE_MAX];
        uint64_t ram_mib;
        uint64_t smp;
        bool suspended;
};

static const char *const image_names[_MANIFEST_IMAGE_MAX] = {
        [MANIFEST_IMAGE_DISK] = "disk",
        [MANIFEST_IMAGE_MEMORY] = "memory",
};

/* Names that are files of their own in a version directory ("Parcel store layout"). */
static const char *const reserved_blob_names[] = { "manifest", "keyring.disk", "keyring.memory" };

/* Logs why the manifest is refused and makes the enclosing check function return false. */
#define REQUIRE(cond, ...)                                                 \
        do {                                                               \
                if (!(cond)) {                                             \
                        log_debug("failed to parse manifest: " __VA_ARGS__); \
                        return false;                                      \
                }                                                          \
        } while (0)

/* --- field helpers ---------------------------------------------------------------------------------- */

/* A JSON integer (never a boolean or a real) in [0, INT64_MAX]. */
static bool get_uint(const json_t *v, uint64_t *ret) {
        if (!json_is_integer(v) || json_integer_value(v) < 0)
                return false;
        *ret = (uint64_t) json_integer_value(v);
        return true;
}

/* Lowercase canonical 8-4-4-4-12, or either case when lowercase_only is false. */
static bool uuid_string_valid(const char *s, bool lowercase_only) {
        if (!s || strlen(s) != MANIFEST_UUID_STRING_LEN)
                return false;
        for (int i = 0; i < MANIFEST_UUID_STRING_LEN; i++) {
                if (i == 8 || i == 13 || i == 18 || i == 23) {
                        if (s[i] != '-')
                                return false;
                } else if (!(s[i] >= '0' && s[i] <= '9') && !(s[i] >= 'a' && s[i] <= 'f') &&
                           (lowercase_only || !(s[i] >= 'A' && s[i] <= 'F'))) {
                        return false;
                }
        }
        return true;
}

/* 64 lowercase hex digits. */
static bool digest_parse(const json_t *v, uint8_t ret[MANIFEST_DIGEST_LEN]) {
        const char *s = json_string_value(v);

        if (!s || strlen(s) != 2 * MANIFEST_DIGEST_LEN)
                return false;
        for (const char *p = s; *p; p++)
                if (!(*p >= '0' && *p <= '9') && !(*p >= 'a' && *p <= 'f'))
                        return false;
        return hex_decode_exact(s, ret, MANIFEST_DIGEST_LEN) == 0;
}

/* Number of characters (code points) of a string jansson has already checked to be valid UTF-8. */
static size_t utf8_length(const char *s) {
        size_t n = 0;

        for (; *s; s++)
                n += ((unsigned char) *s & 0xc0) != 0x80;
        return n;
}

static bool all_digits(const char *s, size_t len) {
        for (size_t i = 0; i < len; i++)
                if (!isdigit((unsigned char) s[i]))
                        return false;
        return len > 0;
}

static unsigned digits_value(const char *s, size_t len) {
        unsigned v = 0;

        for (size_t i = 0; i < len; i++)
                v = v * 10 + (unsigned) (s[i] - '0');
        return v;
}

/* RFC 3339 in UTC: YYYY-MM-DDTHH:MM:SS[.frac](Z|+00:00), T and Z in either case, a real date and time
 * (second 60 allowed for a leap second, year 0 not). */
static bool time_valid(const char *s) {
        static const unsigned days_in_month[] = { 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31 };
        size_t len = s ? strlen(s) : 0, pos = 19;
        unsigned year, month, day, hour, minute, second, days;

        if (len < 20 || !all_digits(s, 4) || s[4] != '-' || !all_digits(s + 5, 2) || s[7] != '-' ||
            !all_digits(s + 8, 2) || (s[10] != 'T' && s[10] != 't') || !all_digits(s + 11, 2) || s[13] != ':' ||
            !all_digits(s + 14, 2) || s[16] != ':' || !all_digits(s + 17, 2))
                return false;
        if (s[pos] == '.') {
                size_t start = ++pos;

                while (pos < len && isdigit((unsigned char) s[pos]))
                        pos++;
                if (pos == start)
                        return false;
        }
        if (!((len - pos == 1 && (s[pos] == 'Z' || s[pos] == 'z')) || (len - pos == 6 && strcmp(s + pos, "+00:00") == 0)))
                return false;

        year = digits_value(s, 4);
        month = digits_value(s + 5, 2);
        day = digits_value(s + 8, 2);
        hour = digits_value(s + 11, 2);
        minute = digits_value(s + 14, 2);
        second = digits_value(s + 17, 2);
        /* Year 0 is valid RFC 3339 but not a Python datetime: both readers refuse it (found by fuzzing). */
        if (year < 1 || month < 1 || month > 12 || hour > 23 || minute > 59 || second > 60)
                return false;
        days = days_in_month[month - 1];
        if (month == 2 && year % 4 == 0 && (year % 100 != 0 || year % 400 == 0))
                days = 29;
        return day >= 1 && day <= days;
}

/* [a-z0-9][a-z0-9._-]{0,63} */
static bool blob_name_valid(const char *s) {
        size_t len = strlen(s);

        if (len < 1 || len > BLOB_NAME_MAX || !((s[0] >= 'a' && s[0] <= 'z') || isdigit((unsigned char) s[0])))
                return false;
        for (size_t i = 1; i < len; i++)
                if (!((s[i] >= 'a' && s[i] <= 'z') || isdigit((unsigned char) s[i]) || s[i] == '.' || s[i] == '_' ||
                      s[i] == '-'))
                        return false;
        for (size_t i = 0; i < sizeof(reserved_blob_names) / sizeof(reserved_blob_names[0]); i++)
                if (strcmp(s, reserved_blob_names[i]) == 0)
                        return false;
        return true;
}

/* A versioned QEMU machine type, never an alias: [a-z0-9][a-z0-9_.-]*-[0-9]+\.[0-9]+ ("pc-q35-7.2"). */
static bool machine_valid(const char *s) {
        const char *dash = strrchr(s, '-'), *dot;

        if (!dash || dash == s)
                return false;
        for (const char *p = s; p < dash; p++)
                if (!((*p >= 'a' && *p <= 'z') || isdigit((unsigned char) *p) ||
                      (p > s && (*p == '_' || *p == '.' || *p == '-'))))
                        return false;
        dot = strchr(dash + 1, '.');
        return dot && all_digits(dash + 1, (size_t) (dot - dash - 1)) && all_digits(dot + 1, strlen(dot + 1));
}

static int compare_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *) a, y = *(const uint64_t *) b;

        return x < y ? -1 : x > y;
}

/* --- the checks, one per part of the manifest -------------------------------------------------------- */

static bool check_top_level(Manifest *m, const json_t *root, const char *want_parcel, uint64_t want_version) {
        const json_t *parent = json_object_get(root, "parent");
        const char *parcel = json_string_value(json_object_get(root, "parcel"));
        const char *name = json_string_value(json_object_get(root, "name"));
        uint64_t format = 0, chunk_size = 0;

        REQUIRE(json_is_object(root), "not a JSON object");
        /* format first: a reader must refuse a format it does not know, whatever else the manifest holds. */
        REQUIRE(get_uint(json_object_get(root, "format"), &format) && format == MANIFEST_FORMAT, "format is not 1");

        REQUIRE(parcel, "parcel missing or not a string");
        REQUIRE(uuid_string_valid(parcel, true), "parcel is not a lowercase canonical UUID");
        REQUIRE(strcmp(parcel, want_parcel) == 0, "parcel %s, expected %s", parcel, want_parcel);
        memcpy(m->parcel, parcel, sizeof(m->parcel));

        REQUIRE(json_is_integer(json_object_get(root, "version")), "version missing or not an integer");
        REQUIRE(get_uint(json_object_get(root, "version"), &m->version) && m->version >= 1, "version below 1");
        REQUIRE(m->version == want_version, "version %llu, expected %llu", (unsigned long long) m->version,
                (unsigned long long) want_version);

        REQUIRE(name, "name missing or not a string");
        REQUIRE(utf8_length(name) >= 1 && utf8_length(name) <= MANIFEST_NAME_MAX, "name must be 1 to 64 characters");

        REQUIRE(parent && (json_is_null(parent) || json_is_integer(parent)), "parent missing or not an integer or null");
        if (m->version == 1)
                REQUIRE(json_is_null(parent), "version 1 must have a null parent");
        else
                REQUIRE(json_is_integer(parent) && (uint64_t) json_integer_value(parent) == m->version - 1 &&
                                json_integer_value(parent) >= 0,
                        "parent must be version - 1");

        REQUIRE(time_valid(json_string_value(json_object_get(root, "created"))), "created is not an RFC 3339 UTC time");

        REQUIRE(get_uint(json_object_get(root, "chunk_size"), &chunk_size) && chunk_size_valid(chunk_size),
                "invalid chunk_size");
        m->chunk_size = (uint32_t) chunk_size;

        REQUIRE(json_is_boolean(json_object_get(root, "suspended")), "suspended missing or not a boolean");
        m->suspended = json_is_true(json_object_get(root, "suspended"));
        return true;
}

static bool check_images(Manifest *m, const json_t *root) {
        const json_t *images = json_object_get(root, "images");

        REQUIRE(json_is_object(images) && json_object_size(images) == _MANIFEST_IMAGE_MAX,
                "images must be exactly disk and memory");
        for (ManifestImageId id = 0; id < _MANIFEST_IMAGE_MAX; id++) {
                const json_t *image = json_object_get(images, image_names[id]);
                const json_t *keyring = json_object_get(image, "keyring"), *own;
                ManifestImage *info = &m->images[id];
                uint64_t own_size = 0;

                REQUIRE(json_is_object(image) && json_is_object(keyring), "images.%s missing or malformed", image_names[id]);
                REQUIRE(get_uint(json_object_get(image, "size"), &info->size) && info->size % 512 == 0,
                        "images.%s.size must be a multiple of 512", image_names[id]);
                REQUIRE(digest_parse(json_object_get(keyring, "sha256"), info->keyring_sha256),
                        "images.%s.keyring.sha256 must be 64 lowercase hex digits", image_names[id]);
                REQUIRE(get_uint(json_object_get(keyring, "size"), &info->keyring_size) &&
                                get_uint(json_object_get(image, "chunks"), &info->chunks),
                        "images.%s sizes missing or invalid", image_names[id]);
                own = json_object_get(image, "chunk_size");
                info->chunk_size = m->chunk_size;
                if (own && !json_is_null(own)) {
                        REQUIRE(get_uint(own, &own_size) && chunk_size_valid(own_size),
                                "invalid images.%s.chunk_size", image_names[id]);
                        info->chunk_size = (uint32_t) own_size;
                }
                REQUIRE(info->chunks <= chunk_count(info->size, info->chunk_size), "images.%s.chunks out of range",
                        image_names[id]);
                REQUIRE(info->keyring_size == KEYRING_HEADER_LEN + KEYRING_RECORD_LEN * info->chunks,
                        "images.%s.keyring.size does not match its record count", image_names[id]);
        }
        return true;
}

static bool check_blobs(const json_t *root) {
        const json_t *blobs = json_object_get(root, "blobs"), *blob;
        const char *name;

        REQUIRE(json_is_object(blobs), "blobs missing or not an object");
        json_object_foreach((json_t *) blobs, name, blob) {
                uint8_t digest[MANIFEST_DIGEST_LEN];
                uint64_t kind = 0, size = 0;

                REQUIRE(blob_name_valid(name), "invalid or reserved blob name");
                REQUIRE(json_is_object(blob), "blobs.%s is not an object", name);
                REQUIRE(get_uint(json_object_get(blob, "kind"), &kind) &&
                                (kind == BLOB_KIND_DEVICE_STATE || kind == BLOB_KIND_BOOT_FILE),
                        "blobs.%s.kind must be 3 or 4", name);
                REQUIRE(digest_parse(json_object_get(blob, "sha256"), digest), "blobs.%s.sha256 is not a digest", name);
                REQUIRE(get_uint(json_object_get(blob, "size"), &size), "blobs.%s.size is invalid", name);
        }
        return true;
}

/* A string, or (when optional) absent or null. */
static bool string_or_absent(const json_t *v, bool optional) {
        return json_is_string(v) || (optional && (!v || json_is_null(v)));
}

static bool names_boot_blob(const json_t *root, const json_t *name) {
        const json_t *blob = json_object_get(json_object_get(root, "blobs"), json_string_value(name));

        return json_is_string(name) && json_is_object(blob) &&
               json_integer_value(json_object_get(blob, "kind")) == BLOB_KIND_BOOT_FILE;
}

static bool check_vm(Manifest *m, const json_t *root) {
        const json_t *vm = json_object_get(root, "vm"), *devices, *boot, *device, *firmware;
        const char *machine, *cpu, *key;

        REQUIRE(json_is_object(vm), "vm missing or not an object");
        machine = json_string_value(json_object_get(vm, "machine"));
        cpu = json_string_value(json_object_get(vm, "cpu"));
        REQUIRE(machine && machine_valid(machine), "vm.machine must be a versioned QEMU machine type");
        REQUIRE(cpu && *cpu, "vm.cpu missing or empty");
        REQUIRE(get_uint(json_object_get(vm, "ram_mib"), &m->ram_mib) && m->ram_mib >= 1 && m->ram_mib <= (UINT64_MAX >> 20),
                "vm.ram_mib must be >= 1");
        REQUIRE(m->images[MANIFEST_IMAGE_MEMORY].size == m->ram_mib << 20, "images.memory.size must be vm.ram_mib MiB");
        REQUIRE(get_uint(json_object_get(vm, "smp"), &m->smp) && m->smp >= 1, "vm.smp must be >= 1");
        REQUIRE(string_or_absent(json_object_get(vm, "qemu_version"), true), "vm.qemu_version must be a string");
        firmware = json_object_get(vm, "firmware");
        REQUIRE(string_or_absent(firmware, true), "vm.firmware must be a string");
        if (json_is_string(firmware))
                REQUIRE(!strcmp(json_string_value(firmware), "bios") || !strcmp(json_string_value(firmware), "uefi"),
                        "vm.firmware must be one of bios, uefi");

        devices = json_object_get(vm, "devices");
        REQUIRE(json_is_object(devices), "vm.devices missing or not an object");
        json_object_foreach((json_t *) devices, key, device)
                REQUIRE(json_is_string(device), "vm.devices.%s must be a string", key);

        boot = json_object_get(vm, "boot");
        if (boot && !json_is_null(boot)) {
                const json_t *initrd = json_object_get(boot, "initrd");

                REQUIRE(json_is_object(boot), "vm.boot must be an object");
                REQUIRE(names_boot_blob(root, json_object_get(boot, "kernel")), "vm.boot.kernel is not a boot blob");
                REQUIRE(string_or_absent(initrd, true), "vm.boot.initrd must be a string");
                if (json_is_string(initrd))
                        REQUIRE(names_boot_blob(root, initrd), "vm.boot.initrd is not a boot blob");
                REQUIRE(string_or_absent(json_object_get(boot, "cmdline"), true), "vm.boot.cmdline must be a string");
        }
        return true;
}

static bool check_working_set(Manifest *m, const json_t *root) {
        const json_t *working_set = json_object_get(root, "working_set");

        REQUIRE(json_is_object(working_set), "working_set missing or not an object");
        for (ManifestImageId id = 0; id < _MANIFEST_IMAGE_MAX; id++) {
                const json_t *list = json_object_get(working_set, image_names[id]);
                uint64_t limit = chunk_count(m->images[id].size, m->images[id].chunk_size), *sorted;
                size_t n = json_array_size(list);
                bool unique = true;

                REQUIRE(json_is_array(list), "working_set.%s missing or not a list", image_names[id]);
                m->working_set[id] = calloc(n ? n : 1, sizeof(uint64_t));
                sorted = calloc(n ? n : 1, sizeof(uint64_t));
                if (!m->working_set[id] || !sorted) {
                        free(sorted);
                        REQUIRE(false, "out of memory");
                }
                m->working_set_len[id] = n;
                for (size_t i = 0; i < n; i++) {
                        uint64_t idx = 0;

                        if (!get_uint(json_array_get(list, i), &idx) || idx >= limit) {
                                free(sorted);
                                REQUIRE(false, "working_set.%s index out of range", image_names[id]);
                        }
                        m->working_set[id][i] = sorted[i] = idx;
                }
                qsort(sorted, n, sizeof(uint64_t), compare_u64);
                for (size_t i = 1; i < n; i++)
                        unique = unique && sorted[i] != sorted[i - 1];
                free(sorted);
                REQUIRE(unique, "working_set.%s lists an index twice", image_names[id]);
        }
        return true;
}

static bool check_timestamps_and_state(const Manifest *m, const json_t *root) {
        const json_t *timestamps = json_object_get(root, "timestamps"), *suspended_at, *devstate;

        REQUIRE(json_is_object(timestamps), "timestamps missing or not an object");
        REQUIRE(time_valid(json_string_value(json_object_get(timestamps, "created"))),
                "timestamps.created is not an RFC 3339 UTC time");
        suspended_at = json_object_get(timestamps, "suspended");
        REQUIRE(suspended_at, "timestamps.suspended is missing");
        REQUIRE(json_is_null(suspended_at) || time_valid(json_string_value(suspended_at)),
                "timestamps.suspended is not null or an RFC 3339 UTC time");

        if (m->suspended) {
                devstate = json_object_get(json_object_get(root, "blobs"), "devstate");
                REQUIRE(json_is_object(devstate) &&
                                json_integer_value(json_object_get(devstate, "kind")) == BLOB_KIND_DEVICE_STATE,
                        "a suspended version needs a devstate blob of kind 3");
                REQUIRE(json_is_string(json_object_get(json_object_get(root, "vm"), "qemu_version")),
                        "a suspended version needs vm.qemu_version");
                REQUIRE(!json_is_null(suspended_at), "a suspended version needs timestamps.suspended");
        }
        return true;
}

/* --- opening ----------------------------------------------------------------------------------------- */

int manifest_parse(const char *json, size_t len, const char *parcel, uint64_t version, Manifest **ret) {
        char want_parcel[MANIFEST_UUID_STRING_LEN + 1];
        json_error_t error;
        Manifest *m;
        int r = 0;

        if (!uuid_string_valid(parcel, false) || version == 0)
                return -EINVAL;
        for (int i = 0; i <= MANIFEST_UUID_STRING_LEN; i++)
                want_parcel[i] = (char) tolower((unsigned char) parcel[i]);

        m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        m->root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &error);
        if (!m->root) {
                log_debug("failed to parse manifest: invalid JSON at line %d: %s", error.line, error.text);
                r = -EBADMSG;
                goto out_free;
        }
        /* Each check logs its reason; images come before vm and working_set, which use their sizes. */
        if (!check_top_level(m, m->root, want_parcel, version) || !check_images(m, m->root) || !check_blobs(m->root) ||
            !check_vm(m, m->root) || !check_working_set(m, m->root) || !check_timestamps_and_state(m, m->root)) {
                r = -EBADMSG;
                goto out_free;
        }
        *ret = m;
        return 0;

out_free:
        manifest_free(m);
        return r;
}

int manifest_open(const uint8_t parcel_key[MANIFEST_PARCEL_KEY_LEN], const void *blob, size_t blob_len,
                  const char *parcel, uint64_t version, Manifest **ret) {
        uint8_t *payload = NULL;
        size_t len = 0;
        int r;

        if (!uuid_string_valid(parcel, false) || version == 0)
                return -EINVAL;
        r = seal_open(parcel_key, blob, blob_len, SEAL_KIND_MANIFEST, MANIFEST_PAYLOAD_MAX, &payload, &len);
        if (r < 0)
                return r;
        r = manifest_parse((const char *) payload, len, parcel, version, ret);
        free(payload);
        return r;
}

Manifest *manifest_free(Manifest *m) {
        if (!m)
                return NULL;
        for (ManifestImageId id = 0; id < _MANIFEST_IMAGE_MAX; id++)
                free(m->working_set[id]);
        json_decref(m->root);
        free(m);
        return NULL;
}

const char *manifest_parcel(const Manifest *m) {
        return m->parcel;
}

const char *manifest_name(const Manifest *m) {
        return json_string_value(json_object_get(m->root, "name"));
}

uint64_t manifest_version(const Manifest *m) {
        return m->version;
}

uint32_t manifest_chunk_size(const Manifest *m) {
        return m->chunk_size;
}

const ManifestImage *manifest_image(const Manifest *m, ManifestImageId id) {
        return id < _MANIFEST_IMAGE_MAX ? &m->images[id] : NULL;
}

const char *manifest_image_name(ManifestImageId id) {
        return id < _MANIFEST_IMAGE_MAX ? image_names[id] : NULL;
}

uint64_t manifest_ram_mib(const Manifest *m) {
        return m->ram_mib;
}

bool manifest_suspended(const Manifest *m) {
        return m->suspended;
}

void manifest_working_set(const Manifest *m, ManifestImageId id, const uint64_t **ret_indices, size_t *ret_n) {
        *ret_indices = id < _MANIFEST_IMAGE_MAX ? m->working_set[id] : NULL;
        *ret_n = id < _MANIFEST_IMAGE_MAX ? m->working_set_len[id] : 0;
}

int manifest_blob(const Manifest *m, const char *name, ManifestBlob *ret) {
        const json_t *blob = json_object_get(json_object_get(m->root, "blobs"), name);

        if (!blob)
                return -ENOENT;
        /* Validated at open: kind 3 or 4, a digest, a size. */
        ret->kind = (unsigned) json_integer_value(json_object_get(blob, "kind"));
        ret->size = (uint64_t) json_integer_value(json_object_get(blob, "size"));
        return hex_decode_exact(json_string_value(json_object_get(blob, "sha256")), ret->sha256, MANIFEST_DIGEST_LEN);
}

static const char *vm_string(const Manifest *m, const char *key) {
        return json_string_value(json_object_get(json_object_get(m->root, "vm"), key));
}

const char *manifest_machine(const Manifest *m) {
        return vm_string(m, "machine");
}

uint64_t manifest_smp(const Manifest *m) {
        return m->smp;
}

const char *manifest_qemu_version(const Manifest *m) {
        return vm_string(m, "qemu_version");
}
