/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Checks every shared test vector in the parcels/testvectors/ files (syntax: parcels/testvectors/README.md)
 * against libvulpes_core: ok vectors must decode to the given values (and encode to the same bytes where
 * the README says so), reject vectors must be refused.  A missing vector file fails the test.
 * manifest.c enforces every manifest rule, so manifest vectors of every `layer` (seal, identity and
 * rules, though the README asks the C side only for the first two) must be refused here.
 *
 * usage: test_vectors DIRECTORY
 * Prints one line per vector and a final count.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "chunk.h"
#include "compress.h"
#include "crypto.h"
#include "envelope.h"
#include "hex.h"
#include "keyring.h"
#include "log.h"
#include "manifest.h"
#include "seal.h"

static const char *vector_dir;
static char temp_dir[] = "/tmp/test_vectors.XXXXXX";
static unsigned n_checked, n_ok_vectors, n_reject_vectors, n_failed;

/* --- parsing ---------------------------------------------------------------------------------------- */

typedef struct Vector {
        char *section;
        unsigned line;
        size_t n_fields;
        char **keys;
        char **values;
} Vector;

typedef struct VectorFile {
        Vector *vectors;
        size_t n_vectors;
} VectorFile;

static void vector_file_free(VectorFile *vf) {
        for (size_t i = 0; i < vf->n_vectors; i++) {
                Vector *v = &vf->vectors[i];

                for (size_t j = 0; j < v->n_fields; j++) {
                        free(v->keys[j]);
                        free(v->values[j]);
                }
                free(v->keys);
                free(v->values);
                free(v->section);
        }
        free(vf->vectors);
}

static bool key_valid(const char *s, size_t len) {
        if (len == 0)
                return false;
        for (size_t i = 0; i < len; i++)
                if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_'))
                        return false;
        return true;
}

/* Returns 0, -ENOENT if the file is missing, -EINVAL on a syntax error (printed). */
static int vector_file_load(const char *name, VectorFile *ret) {
        char path[4096], *line = NULL;
        size_t cap = 0;
        ssize_t len;
        unsigned lineno = 0;
        FILE *fp;
        int r = 0;

        *ret = (VectorFile) { 0 };
        snprintf(path, sizeof(path), "%s/%s", vector_dir, name);
        fp = fopen(path, "re");
        if (!fp)
                return -errno;
        while ((len = getline(&line, &cap, fp)) >= 0) {
                char *eq;

                lineno++;
                while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
                        line[--len] = 0;
                if (len == 0 || line[0] == '#')
                        continue;
                if (line[0] == '[') {
                        Vector *v;

                        if (line[len - 1] != ']' || !key_valid(line + 1, (size_t) len - 2)) {
                                printf("FAIL %s:%u: bad section line\n", name, lineno);
                                r = -EINVAL;
                                break;
                        }
                        v = realloc(ret->vectors, (ret->n_vectors + 1) * sizeof(*v));
                        assert_non_null(v);
                        ret->vectors = v;
                        v = &ret->vectors[ret->n_vectors++];
                        *v = (Vector) { .section = strndup(line + 1, (size_t) len - 2), .line = lineno };
                        continue;
                }
                eq = strstr(line, " = ");
                if (!eq || ret->n_vectors == 0 || !key_valid(line, (size_t) (eq - line))) {
                        printf("FAIL %s:%u: expected `key = value` inside a section\n", name, lineno);
                        r = -EINVAL;
                        break;
                }
                {
                        Vector *v = &ret->vectors[ret->n_vectors - 1];

                        v->keys = realloc(v->keys, (v->n_fields + 1) * sizeof(char *));
                        v->values = realloc(v->values, (v->n_fields + 1) * sizeof(char *));
                        assert_true(v->keys && v->values);
                        v->keys[v->n_fields] = strndup(line, (size_t) (eq - line));
                        v->values[v->n_fields] = strdup(eq + 3);
                        v->n_fields++;
                }
        }
        free(line);
        fclose(fp);
        if (r < 0)
                vector_file_free(ret);
        return r;
}

static const char *field(const Vector *v, const char *key) {
        for (size_t i = 0; i < v->n_fields; i++)
                if (strcmp(v->keys[i], key) == 0)
                        return v->values[i];
        return NULL;
}

/* --- checking --------------------------------------------------------------------------------------- */

/* The outcome of one vector: failure text (NULL for pass) and a note on what was checked. */
typedef struct Check {
        const char *file;
        const Vector *vector;
        char failure[256];
        char note[256];
} Check;

static void check_fail(Check *c, const char *format, ...) __attribute__((format(printf, 2, 3)));
static void check_fail(Check *c, const char *format, ...) {
        va_list ap;

        if (c->failure[0])
                return;
        va_start(ap, format);
        vsnprintf(c->failure, sizeof(c->failure), format, ap);
        va_end(ap);
}

static void check_note(Check *c, const char *text) {
        size_t len = strlen(c->note);

        snprintf(c->note + len, sizeof(c->note) - len, "%s%s", len ? ", " : "", text);
}

/* Field getters: they record a failure for a missing or malformed field and return false. */
static bool get_hex(Check *c, const char *key, uint8_t **ret, size_t *ret_len) {
        const char *s = field(c->vector, key);

        if (!s) {
                check_fail(c, "missing field %s", key);
                return false;
        }
        if (hex_decode(s, strlen(s), ret, ret_len) < 0) {
                check_fail(c, "field %s is not hex", key);
                return false;
        }
        return true;
}

static bool get_hex_exact(Check *c, const char *key, uint8_t *ret, size_t len) {
        uint8_t *data = NULL;
        size_t data_len = 0;

        if (!get_hex(c, key, &data, &data_len))
                return false;
        if (data_len != len) {
                free(data);
                check_fail(c, "field %s is %zu bytes, not %zu", key, data_len, len);
                return false;
        }
        memcpy(ret, data, len);
        free(data);
        return true;
}

static bool get_uint(Check *c, const char *key, uint64_t *ret) {
        const char *s = field(c->vector, key);
        char *end;

        if (!s || !*s || *s == '-') {
                check_fail(c, "missing or invalid integer field %s", key);
                return false;
        }
        errno = 0;
        *ret = strtoull(s, &end, 10);
        if (errno || *end) {
                check_fail(c, "invalid integer field %s", key);
                return false;
        }
        return true;
}

static bool expect_ok(const Check *c) {
        return strcmp(field(c->vector, "result"), "ok") == 0;
}

/* For a reject vector, a field that cannot even be handed to the API counts as a rejection. */
static void reject_on_bad_field(Check *c, const char *why) {
        if (!expect_ok(c) && c->failure[0]) {
                c->failure[0] = 0;
                check_note(c, why);
        }
}

static void check_chunk(Check *c) {
        uint8_t secret[CHUNK_SECRET_LEN], tag[CHUNK_TAG_LEN], key[CHUNK_KEY_LEN];
        uint8_t *object = NULL, *plaintext = NULL, *out = NULL, *mine = NULL;
        uint8_t my_tag[CHUNK_TAG_LEN], my_key[CHUNK_KEY_LEN], my_flags = 0;
        size_t object_len = 0, plaintext_len = 0, my_len = 0;
        uint64_t n = 0, flags = 0;
        int r;

        if (!get_hex(c, "object", &object, &object_len) || !get_hex_exact(c, "tag", tag, sizeof(tag)) ||
            !get_hex_exact(c, "key", key, sizeof(key)) || !get_uint(c, "length", &n)) {
                reject_on_bad_field(c, "rejected: field unusable");
                goto out;
        }
        out = malloc(n + 1);
        assert_non_null(out);
        r = chunk_decode(object, object_len, tag, key, n, out);

        if (!expect_ok(c)) {
                if (r == 0)
                        check_fail(c, "decoded although it must be rejected");
                else
                        check_note(c, "rejected by decode");
                goto out;
        }
        if (r < 0) {
                check_fail(c, "decode failed: %s", strerror(-r));
                goto out;
        }
        if (!get_hex(c, "plaintext", &plaintext, &plaintext_len) || !get_hex_exact(c, "secret", secret, sizeof(secret)) ||
            !get_uint(c, "flags", &flags))
                goto out;
        if (plaintext_len != n || memcmp(out, plaintext, n) != 0) {
                check_fail(c, "decoded plaintext differs");
                goto out;
        }
        check_note(c, "decoded");

        mine = malloc(chunk_object_max_len(n));
        assert_non_null(mine);
        r = chunk_encode(plaintext, n, secret, COMPRESS_LEVEL_DEFAULT, mine, &my_len, my_tag, my_key, &my_flags);
        if (r < 0) {
                check_fail(c, "encode failed: %s", strerror(-r));
                goto out;
        }
        if (flags == 0) {
                if (my_flags != 0 || my_len != object_len || memcmp(mine, object, object_len) != 0 ||
                    memcmp(my_tag, tag, sizeof(tag)) != 0 || memcmp(my_key, key, sizeof(key)) != 0)
                        check_fail(c, "encoding differs from the vector (flags %u, %zu bytes)", my_flags, my_len);
                else
                        check_note(c, "encode identical");
        } else {
                /* zstd output may differ between versions: our own object must decode to the plaintext. */
                r = chunk_decode(mine, my_len, my_tag, my_key, n, out);
                if (r < 0 || memcmp(out, plaintext, n) != 0)
                        check_fail(c, "own encoding does not decode");
                else if (my_flags != flags)
                        check_fail(c, "own encoding has flags %u, vector %llu", my_flags, (unsigned long long) flags);
                else
                        check_note(c, my_len == object_len && memcmp(mine, object, object_len) == 0
                                              ? "encode identical"
                                              : "own encoding decodes (zstd output differs)");
        }
out:
        free(object);
        free(plaintext);
        free(out);
        free(mine);
}

static void check_blob(Check *c) {
        uint8_t pk[SEAL_PARCEL_KEY_LEN], *blob = NULL, *payload = NULL, *opened = NULL, *resealed = NULL, *reopened = NULL;
        size_t blob_len = 0, payload_len = 0, opened_len = 0, resealed_len = 0, reopened_len = 0;
        uint64_t kind = 0, max_length = 0;
        int r;

        if (!get_hex_exact(c, "parcel_key", pk, sizeof(pk)) || !get_uint(c, "kind", &kind) ||
            !get_uint(c, "max_length", &max_length) || !get_hex(c, "blob", &blob, &blob_len)) {
                reject_on_bad_field(c, "rejected: field unusable");
                goto out;
        }
        r = seal_open(pk, blob, blob_len, (SealKind) (kind > 255 ? 0 : kind), max_length, &opened, &opened_len);
        if (!expect_ok(c)) {
                if (r == 0)
                        check_fail(c, "opened although it must be rejected");
                else
                        check_note(c, "rejected by open");
                goto out;
        }
        if (r < 0) {
                check_fail(c, "open failed: %s", strerror(-r));
                goto out;
        }
        if (!get_hex(c, "payload", &payload, &payload_len))
                goto out;
        if (opened_len != payload_len || memcmp(opened, payload, payload_len) != 0) {
                check_fail(c, "opened payload differs");
                goto out;
        }
        check_note(c, "opened");
        r = seal_blob(pk, (SealKind) kind, payload, payload_len, COMPRESS_LEVEL_DEFAULT, &resealed, &resealed_len);
        if (r == 0)
                r = seal_open(pk, resealed, resealed_len, (SealKind) kind, max_length, &reopened, &reopened_len);
        if (r < 0 || reopened_len != payload_len || memcmp(reopened, payload, payload_len) != 0)
                check_fail(c, "own seal does not open");
        else
                check_note(c, "own seal opens");
out:
        free(blob);
        free(payload);
        free(opened);
        free(resealed);
        free(reopened);
}

static void check_envelope(Check *c) {
        uint8_t uuid[ENVELOPE_UUID_LEN], got_uuid[ENVELOPE_UUID_LEN], got_pk[ENVELOPE_KEY_LEN], got_cs[ENVELOPE_KEY_LEN];
        uint8_t pk[ENVELOPE_KEY_LEN], cs[ENVELOPE_KEY_LEN], mine[ENVELOPE_LEN];
        uint8_t *envelope = NULL, *secret = NULL;
        size_t envelope_len = 0, secret_len = 0;
        EnvelopeCredential credential;
        const char *kdf = field(c->vector, "kdf");
        int r;

        if (!kdf || (strcmp(kdf, "scrypt") != 0 && strcmp(kdf, "keyfile") != 0)) {
                check_fail(c, "field kdf must be scrypt or keyfile");
                goto out;
        }
        if (!get_hex(c, strcmp(kdf, "scrypt") == 0 ? "passphrase" : "keyfile", &secret, &secret_len) ||
            !get_hex_exact(c, "uuid", uuid, sizeof(uuid)) || !get_hex(c, "envelope", &envelope, &envelope_len)) {
                reject_on_bad_field(c, "rejected: field unusable");
                goto out;
        }
        credential = (EnvelopeCredential) {
                strcmp(kdf, "scrypt") == 0 ? ENVELOPE_KDF_SCRYPT : ENVELOPE_KDF_KEYFILE, secret, secret_len,
        };
        r = envelope_unwrap(&credential, envelope, envelope_len, got_uuid, got_pk, got_cs);

        if (!expect_ok(c)) {
                if (r < 0)
                        check_note(c, "rejected by unwrap");
                else if (memcmp(got_uuid, uuid, sizeof(uuid)) != 0)
                        check_note(c, "rejected: UUID is not the parcel asked for");
                else
                        check_fail(c, "unwrapped although it must be rejected");
                goto out;
        }
        if (r < 0) {
                check_fail(c, "unwrap failed: %s", strerror(-r));
                goto out;
        }
        if (!get_hex_exact(c, "parcel_key", pk, sizeof(pk)) || !get_hex_exact(c, "convergence_secret", cs, sizeof(cs)))
                goto out;
        if (memcmp(got_uuid, uuid, sizeof(uuid)) != 0 || memcmp(got_pk, pk, sizeof(pk)) != 0 ||
            memcmp(got_cs, cs, sizeof(cs)) != 0) {
                check_fail(c, "unwrapped values differ");
                goto out;
        }
        check_note(c, "unwrapped");

        /* Rewrap with the same parameters; the salt is fresh, so compare by unwrapping. */
        {
                EnvelopeScryptParams params = {
                        envelope[56],
                        (uint32_t) envelope[60] << 24 | (uint32_t) envelope[61] << 16 | envelope[62] << 8 | envelope[63],
                        (uint32_t) envelope[64] << 24 | (uint32_t) envelope[65] << 16 | envelope[66] << 8 | envelope[67],
                };

                r = envelope_wrap(&credential, &params, uuid, pk, cs, mine);
                if (r == 0)
                        r = envelope_unwrap(&credential, mine, sizeof(mine), got_uuid, got_pk, got_cs);
                if (r < 0 || memcmp(got_pk, pk, sizeof(pk)) != 0 || memcmp(got_cs, cs, sizeof(cs)) != 0 ||
                    memcmp(mine, envelope, 24) != 0 || memcmp(mine + 56, envelope + 56, 12) != 0)
                        check_fail(c, "own wrap differs in its header or does not unwrap");
                else
                        check_note(c, "own wrap unwraps");
        }
out:
        free(envelope);
        if (secret)
                crypto_wipe(secret, secret_len);
        free(secret);
}

/* Parses `idx:flags:tag:key,...`: decimal index and flags, hex tag and unwrapped key. */
static bool parse_records(Check *c, const char *s, KeyringRecord **ret, uint8_t (**ret_keys)[KEYRING_KEY_LEN], size_t *ret_n) {
        KeyringRecord *records = NULL;
        uint8_t (*keys)[KEYRING_KEY_LEN] = NULL;
        size_t n = 0;
        char *copy = strdup(s), *save = NULL;

        assert_non_null(copy);
        for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
                char *parts[4], *p = item, *end;
                unsigned long long idx, flags;

                for (int i = 0; i < 4; i++) {
                        parts[i] = strsep(&p, ":");
                        if (!parts[i]) {
                                check_fail(c, "record %zu is not idx:flags:tag:key", n);
                                goto fail;
                        }
                }
                records = realloc(records, (n + 1) * sizeof(*records));
                keys = realloc(keys, (n + 1) * sizeof(*keys));
                assert_true(records && keys);
                errno = 0;
                idx = strtoull(parts[0], &end, 10);
                if (errno || *end || !*parts[0]) {
                        check_fail(c, "record %zu has a bad index", n);
                        goto fail;
                }
                flags = strtoull(parts[1], &end, 10);
                if (*end || !*parts[1] || flags > 255 || hex_decode_exact(parts[2], records[n].tag, KEYRING_TAG_LEN) < 0 ||
                    hex_decode_exact(parts[3], keys[n], KEYRING_KEY_LEN) < 0) {
                        check_fail(c, "record %zu is malformed", n);
                        goto fail;
                }
                records[n].idx = idx;
                records[n].flags = (uint8_t) flags;
                n++;
        }
        free(copy);
        *ret = records;
        *ret_keys = keys;
        *ret_n = n;
        return true;
fail:
        free(copy);
        free(records);
        free(keys);
        return false;
}

static void check_keyring(Check *c) {
        uint8_t pk[KEYRING_PARCEL_KEY_LEN], digest[KEYRING_DIGEST_LEN], my_digest[KEYRING_DIGEST_LEN], key[KEYRING_KEY_LEN];
        uint8_t *stream = NULL, *mine = NULL, *exported = NULL, (*keys)[KEYRING_KEY_LEN] = NULL;
        size_t stream_len = 0, mine_len = 0, exported_len = 0, n_records = 0, n_decoded = 0;
        KeyringRecord *records = NULL, *decoded = NULL;
        uint64_t chunk_size = 0, image_size = 0, digest_len = 0;
        uint64_t got_image_size = 0;
        uint32_t got_chunk_size = 0;
        char db_path[256];
        Keyring *k = NULL;
        const char *records_field;
        int r;

        if (!get_hex_exact(c, "parcel_key", pk, sizeof(pk)) || !get_hex(c, "stream", &stream, &stream_len)) {
                reject_on_bad_field(c, "rejected: field unusable");
                goto out;
        }
        r = keyring_stream_decode(stream, stream_len, &got_chunk_size, &got_image_size, &decoded, &n_decoded);

        if (!expect_ok(c)) {
                if (r < 0) {
                        check_note(c, "rejected by stream decode");
                        /* Import validates the same way and must leave nothing half-written. */
                        snprintf(db_path, sizeof(db_path), "%s/reject-%u.db", temp_dir, n_checked);
                        if (keyring_create(db_path, 4096, 0, &k) < 0 || keyring_import_stream(k, stream, stream_len) != -EBADMSG)
                                check_fail(c, "import did not reject the stream");
                        else
                                check_note(c, "by import");
                        goto out;
                }
                for (size_t i = 0; i < n_decoded; i++)
                        if (keyring_unwrap_key(pk, decoded[i].wkey, key) < 0) {
                                check_note(c, "rejected at unwrap");
                                goto out;
                        }
                check_fail(c, "decoded and unwrapped although it must be rejected");
                goto out;
        }
        if (r < 0) {
                check_fail(c, "stream decode failed: %s", strerror(-r));
                goto out;
        }
        records_field = field(c->vector, "records");
        if (!records_field) {
                check_fail(c, "missing field records");
                goto out;
        }
        if (!get_uint(c, "chunk_size", &chunk_size) || !get_uint(c, "image_size", &image_size) ||
            !get_hex_exact(c, "digest", digest, sizeof(digest)) || !parse_records(c, records_field, &records, &keys, &n_records))
                goto out;
        if (got_chunk_size != chunk_size || got_image_size != image_size || n_decoded != n_records) {
                check_fail(c, "decoded header differs");
                goto out;
        }
        for (size_t i = 0; i < n_decoded; i++) {
                r = keyring_unwrap_key(pk, decoded[i].wkey, key);
                if (r < 0 || decoded[i].idx != records[i].idx || decoded[i].flags != records[i].flags ||
                    memcmp(decoded[i].tag, records[i].tag, KEYRING_TAG_LEN) != 0 || memcmp(key, keys[i], KEYRING_KEY_LEN) != 0) {
                        check_fail(c, "decoded record %zu differs", i);
                        goto out;
                }
        }
        check_note(c, "decoded and unwrapped");

        for (size_t i = 0; i < n_records; i++)
                assert_int_equal(keyring_wrap_key(pk, keys[i], records[i].wkey), 0);
        r = keyring_stream_encode((uint32_t) chunk_size, image_size, records, n_records, &mine, &mine_len);
        if (r < 0 || mine_len != stream_len || memcmp(mine, stream, stream_len) != 0) {
                check_fail(c, "wrapping and encoding does not reproduce the stream");
                goto out;
        }
        assert_int_equal(crypto_sha256(stream, stream_len, my_digest), 0);
        if (memcmp(my_digest, digest, sizeof(digest)) != 0) {
                check_fail(c, "digest differs");
                goto out;
        }
        check_note(c, "encode identical");

        snprintf(db_path, sizeof(db_path), "%s/ok-%u.db", temp_dir, n_checked);
        r = keyring_create(db_path, 4096, 0, &k);
        if (r == 0)
                r = keyring_import_stream(k, stream, stream_len);
        if (r == 0)
                r = keyring_export_stream(k, &exported, &exported_len);
        if (r == 0)
                r = keyring_digest(k, my_digest, &digest_len);
        if (r < 0 || exported_len != stream_len || memcmp(exported, stream, stream_len) != 0 ||
            memcmp(my_digest, digest, sizeof(digest)) != 0 || digest_len != stream_len)
                check_fail(c, "sqlite import/export does not reproduce the stream");
        else
                check_note(c, "sqlite round trip identical");
out:
        keyring_free(k);
        free(stream);
        free(mine);
        free(exported);
        free(records);
        free(keys);
        free(decoded);
}

static void check_manifest(Check *c) {
        uint8_t pk[MANIFEST_PARCEL_KEY_LEN], *blob = NULL, *json = NULL, *payload = NULL;
        size_t blob_len = 0, json_len = 0, payload_len = 0;
        const char *uuid = field(c->vector, "uuid");
        uint64_t version = 0;
        Manifest *m = NULL;
        int r;

        if (!uuid || !get_hex_exact(c, "parcel_key", pk, sizeof(pk)) || !get_uint(c, "version", &version) ||
            !get_hex(c, "blob", &blob, &blob_len)) {
                check_fail(c, "missing or malformed field");
                goto out;
        }
        r = manifest_open(pk, blob, blob_len, uuid, version, &m);
        if (!expect_ok(c)) {
                if (r == 0)
                        check_fail(c, "opened although it must be rejected");
                else
                        check_note(c, "rejected by manifest open");
                goto out;
        }
        if (r < 0) {
                check_fail(c, "manifest open failed: %s", strerror(-r));
                goto out;
        }
        if (!get_hex(c, "json", &json, &json_len))
                goto out;
        r = seal_open(pk, blob, blob_len, SEAL_KIND_MANIFEST, MANIFEST_PAYLOAD_MAX, &payload, &payload_len);
        if (r < 0 || payload_len != json_len || memcmp(payload, json, json_len) != 0) {
                check_fail(c, "opened JSON differs");
                goto out;
        }
        if (strcmp(manifest_parcel(m), uuid) != 0 || manifest_version(m) != version) {
                check_fail(c, "parsed parcel or version differs");
                goto out;
        }
        check_note(c, "opened and parsed");
out:
        manifest_free(m);
        free(blob);
        free(json);
        free(payload);
}

/* --- one cmocka test per file ----------------------------------------------------------------------- */

typedef struct FileSpec {
        const char *name;
        const char *section;
        void (*check)(Check *c);
} FileSpec;

static const FileSpec files[] = {
        { "chunks.txt", "chunk", check_chunk },
        { "blobs.txt", "blob", check_blob },
        { "keyenvelopes.txt", "envelope", check_envelope },
        { "keyrings.txt", "keyring", check_keyring },
        { "manifests.txt", "manifest", check_manifest },
};

static void run_file(void **state) {
        const FileSpec *spec = *state;
        unsigned failures = 0, n_ok = 0, n_reject = 0;
        VectorFile vf;
        int r;

        r = vector_file_load(spec->name, &vf);
        if (r == -ENOENT)
                fail_msg("vector file %s/%s is missing", vector_dir, spec->name);
        if (r < 0)
                fail_msg("cannot read vector file %s/%s: %s", vector_dir, spec->name, strerror(-r));
        if (vf.n_vectors == 0) {
                vector_file_free(&vf);
                fail_msg("vector file %s holds no vectors", spec->name);
        }

        for (size_t i = 0; i < vf.n_vectors; i++) {
                const Vector *v = &vf.vectors[i];
                const char *name = field(v, "name"), *result = field(v, "result"), *why = field(v, "why");
                const char *layer = field(v, "layer");
                Check c = { .file = spec->name, .vector = v };

                for (size_t j = 0; j < i; j++)
                        if (name && field(&vf.vectors[j], "name") && strcmp(name, field(&vf.vectors[j], "name")) == 0)
                                check_fail(&c, "duplicate vector name");
                if (strcmp(v->section, spec->section) != 0)
                        check_fail(&c, "section [%s] in a file of [%s]", v->section, spec->section);
                else if (!name || !result || (strcmp(result, "ok") != 0 && strcmp(result, "reject") != 0))
                        check_fail(&c, "vector needs name and result = ok | reject");
                else
                        spec->check(&c);

                n_checked++;
                if (result && strcmp(result, "ok") == 0)
                        n_ok++;
                else
                        n_reject++;
                if (c.failure[0]) {
                        failures++;
                        printf("FAIL %s:%u %s (%s%s%s%s%s): %s\n", spec->name, v->line, name ? name : "?",
                               result ? result : "?", why ? ", why=" : "", why ? why : "", layer ? ", layer=" : "",
                               layer ? layer : "", c.failure);
                } else {
                        printf("ok   %s %s (%s%s%s%s%s): %s\n", spec->name, name, result, why ? ", why=" : "",
                               why ? why : "", layer ? ", layer=" : "", layer ? layer : "", c.note);
                }
        }
        n_ok_vectors += n_ok;
        n_reject_vectors += n_reject;
        n_failed += failures;
        printf("%s: %zu vectors (%u ok, %u reject), %u failed\n", spec->name, vf.n_vectors, n_ok, n_reject, failures);
        fflush(stdout);
        vector_file_free(&vf);
        if (failures > 0)
                fail_msg("%u of the vectors in %s failed", failures, spec->name);
}

int main(int argc, char **argv) {
        struct CMUnitTest tests[sizeof(files) / sizeof(files[0])];
        char cmd[128];
        int failed;

        if (argc != 2) {
                fprintf(stderr, "usage: %s VECTOR_DIRECTORY\n", argv[0]);
                return 2;
        }
        vector_dir = argv[1];
        log_set_max_level(LOG_CRIT);      /* rejections are the point here; keep the output one line per vector */
        if (!mkdtemp(temp_dir)) {
                perror("mkdtemp");
                return 1;
        }
        for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++)
                tests[i] = (struct CMUnitTest) {
                        .name = files[i].name, .test_func = run_file, .initial_state = (void *) &files[i],
                };

        failed = _cmocka_run_group_tests("vectors", tests, sizeof(tests) / sizeof(tests[0]), NULL, NULL);
        printf("vectors checked: %u (%u ok, %u reject), %u failed\n", n_checked, n_ok_vectors, n_reject_vectors, n_failed);
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", temp_dir);
        if (system(cmd) != 0)
                fprintf(stderr, "failed to remove %s\n", temp_dir);
        return failed;
}
