/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Tests for keyring.c: chunk-key wrapping, keyring streams (round trips and every defect the format names),
 * and the sqlite keyring database (schema, records, import/export, digest, validation on open).
 * The schema is checked with sqlite directly, against the real database file.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "chunk.h"
#include "crypto.h"
#include "keyring.h"

static const uint8_t pk[KEYRING_PARCEL_KEY_LEN] = { 0x11, 0x22, 0x33 };

typedef struct Fixture {
        char dir[64];
        char path[128];
} Fixture;

static int setup(void **state) {
        Fixture *f = calloc(1, sizeof(*f));

        if (!f)
                return -1;
        strcpy(f->dir, "/tmp/test_keyring.XXXXXX");
        if (!mkdtemp(f->dir))
                return -1;
        snprintf(f->path, sizeof(f->path), "%s/keyring.db", f->dir);
        *state = f;
        return 0;
}

static int teardown(void **state) {
        Fixture *f = *state;
        char cmd[160];

        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->dir);
        if (system(cmd) != 0)
                return -1;
        free(f);
        return 0;
}

static void make_record(uint64_t idx, uint8_t flags, KeyringRecord *ret) {
        uint8_t key[KEYRING_KEY_LEN];

        ret->idx = idx;
        ret->flags = flags;
        memset(ret->tag, (int) (idx & 0xff), KEYRING_TAG_LEN);
        ret->tag[0] = 0xee;
        memset(key, (int) ((idx * 7) & 0xff), sizeof(key));
        assert_int_equal(keyring_wrap_key(pk, key, ret->wkey), 0);
}

static void assert_record_equal(const KeyringRecord *a, const KeyringRecord *b) {
        assert_int_equal(a->idx, b->idx);
        assert_int_equal(a->flags, b->flags);
        assert_memory_equal(a->tag, b->tag, KEYRING_TAG_LEN);
        assert_memory_equal(a->wkey, b->wkey, KEYRING_WKEY_LEN);
}

/* A valid stream: chunk size 4096, image of 10 chunks minus a bit, records 0, 3 and 9. */
static void make_stream(uint8_t **ret, size_t *ret_len) {
        KeyringRecord records[3];

        make_record(0, 1, &records[0]);
        make_record(3, 0, &records[1]);
        make_record(9, 1, &records[2]);
        assert_int_equal(keyring_stream_encode(4096, 10 * 4096 - 512, records, 3, ret, ret_len), 0);
        assert_int_equal(*ret_len, KEYRING_STREAM_HEADER_LEN + 3 * KEYRING_RECORD_LEN);
}

static void test_wrap_unwrap(void **state) {
        uint8_t key[KEYRING_KEY_LEN], back[KEYRING_KEY_LEN], wkey[KEYRING_WKEY_LEN], wkey2[KEYRING_WKEY_LEN];
        uint8_t other_pk[KEYRING_PARCEL_KEY_LEN] = { 0x11, 0x22, 0x34 };

        (void) state;
        assert_int_equal(crypto_random_bytes(key, sizeof(key)), 0);
        assert_int_equal(keyring_wrap_key(pk, key, wkey), 0);
        assert_int_equal(keyring_wrap_key(pk, key, wkey2), 0);
        assert_memory_equal(wkey, wkey2, sizeof(wkey));     /* deterministic */
        assert_int_equal(keyring_unwrap_key(pk, wkey, back), 0);
        assert_memory_equal(back, key, sizeof(key));
        assert_int_equal(keyring_unwrap_key(other_pk, wkey, back), -EBADMSG);
        wkey[39] ^= 1;
        assert_int_equal(keyring_unwrap_key(pk, wkey, back), -EBADMSG);
}

static void test_stream_round_trip(void **state) {
        uint8_t *stream = NULL, *stream2 = NULL;
        size_t len, len2, n = 0;
        KeyringRecord *records = NULL, r0;
        uint64_t image_size;
        uint32_t chunk_size;

        (void) state;
        make_stream(&stream, &len);
        assert_memory_equal(stream, "ISRK\x01\x00\x00\x00\x00\x00\x10\x00", 12);
        assert_int_equal(keyring_stream_decode(stream, len, &chunk_size, &image_size, &records, &n), 0);
        assert_int_equal(chunk_size, 4096);
        assert_int_equal(image_size, 10 * 4096 - 512);
        assert_int_equal(n, 3);
        assert_int_equal(records[2].idx, 9);
        make_record(0, 1, &r0);
        assert_record_equal(&records[0], &r0);
        assert_int_equal(keyring_stream_encode(chunk_size, image_size, records, n, &stream2, &len2), 0);
        assert_int_equal(len, len2);
        assert_memory_equal(stream, stream2, len);
        free(records);
        free(stream);
        free(stream2);

        /* An empty keyring is a bare header. */
        assert_int_equal(keyring_stream_encode(131072, 0, NULL, 0, &stream, &len), 0);
        assert_int_equal(len, KEYRING_STREAM_HEADER_LEN);
        records = (KeyringRecord *) 1;
        assert_int_equal(keyring_stream_decode(stream, len, &chunk_size, &image_size, &records, &n), 0);
        assert_int_equal(n, 0);
        assert_null(records);
        free(stream);
}

static void assert_stream_rejected(const uint8_t *stream, size_t len) {
        KeyringRecord *records = NULL;
        uint64_t image_size;
        uint32_t chunk_size;
        size_t n;

        assert_int_equal(keyring_stream_decode(stream, len, &chunk_size, &image_size, &records, &n), -EBADMSG);
        assert_null(records);
}

static void test_stream_rejects(void **state) {
        uint8_t *stream = NULL, *copy;
        size_t len;
        const size_t rec1 = KEYRING_STREAM_HEADER_LEN + KEYRING_RECORD_LEN, rec2 = rec1 + KEYRING_RECORD_LEN;
        KeyringRecord bad[2];
        uint8_t *out = NULL;
        size_t out_len;

        (void) state;
        make_stream(&stream, &len);
        copy = malloc(len + KEYRING_RECORD_LEN);
        assert_non_null(copy);

#define MUTATE(stmt)                                   \
        do {                                           \
                memcpy(copy, stream, len);             \
                stmt;                                  \
                assert_stream_rejected(copy, len);     \
        } while (0)

        MUTATE(copy[0] = 'X');                                  /* magic */
        MUTATE(copy[4] = 2);                                    /* version */
        MUTATE(copy[5] = 1);                                    /* reserved */
        MUTATE(copy[7] = 0x80);
        MUTATE(copy[10] = 0x08);                                /* chunk size 2048 */
        MUTATE((copy[9] = 0x00, copy[10] = 0x30));              /* chunk size 12288: not a power of two */
        MUTATE(copy[9] = 0x80);                                 /* chunk size 0x801000: too large */
        MUTATE(copy[27] = 2);                                   /* count 2, three records present */
        MUTATE(copy[27] = 4);                                   /* count 4 */
        MUTATE(copy[20] = 0x80);                                /* huge count */
        MUTATE(copy[rec1 + 7] = 0);                             /* duplicate index 0 */
        MUTATE(copy[rec2 + 7] = 2);                             /* 9 → 2: decreasing */
        MUTATE(copy[rec2 + 7] = 10);                            /* index 10 of a 10-chunk image */
        MUTATE(copy[rec2] = 0x80);                              /* enormous index */
        MUTATE(copy[rec1 + 8] = 2);                             /* reserved flag bit */
        MUTATE(copy[rec1 + 8] = 0x81);
        MUTATE((copy[12 + 6] = 0, copy[12 + 7] = 0));           /* image size 0: every index out of range */
#undef MUTATE

        /* Unsorted: records 2 and 3 swapped. */
        memcpy(copy, stream, len);
        memcpy(copy + rec1, stream + rec2, KEYRING_RECORD_LEN);
        memcpy(copy + rec2, stream + rec1, KEYRING_RECORD_LEN);
        assert_stream_rejected(copy, len);

        /* Bad lengths. */
        for (size_t l = 0; l < len; l++)
                assert_stream_rejected(stream, l);
        memcpy(copy, stream, len);
        copy[len] = 0;
        assert_stream_rejected(copy, len + 1);
        memcpy(copy + len, stream + rec2, KEYRING_RECORD_LEN);
        assert_stream_rejected(copy, len + KEYRING_RECORD_LEN);

        /* The encoder refuses what the decoder would reject. */
        make_record(5, 0, &bad[0]);
        make_record(5, 0, &bad[1]);
        assert_int_equal(keyring_stream_encode(4096, 40960, bad, 2, &out, &out_len), -EINVAL);
        bad[1].idx = 10;
        assert_int_equal(keyring_stream_encode(4096, 40960, bad, 2, &out, &out_len), -EINVAL);
        bad[1].idx = 6;
        bad[1].flags = 4;
        assert_int_equal(keyring_stream_encode(4096, 40960, bad, 2, &out, &out_len), -EINVAL);
        assert_int_equal(keyring_stream_encode(1000, 40960, bad, 1, &out, &out_len), -EINVAL);
        assert_null(out);

        free(copy);
        free(stream);
}

static int64_t sql_int(sqlite3 *db, const char *sql) {
        sqlite3_stmt *stmt;
        int64_t v;

        assert_int_equal(sqlite3_prepare_v2(db, sql, -1, &stmt, NULL), SQLITE_OK);
        assert_int_equal(sqlite3_step(stmt), SQLITE_ROW);
        v = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
        return v;
}

static void sql_exec(const char *path, const char *sql) {
        sqlite3 *db;

        assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
        assert_int_equal(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
        sqlite3_close(db);
}

static void test_schema(void **state) {
        Fixture *f = *state;
        Keyring *k = NULL;
        sqlite3 *db;
        sqlite3_stmt *stmt;
        char *journal;

        assert_int_equal(keyring_create(f->path, 131072, UINT64_C(1) << 30, &k), 0);
        assert_int_equal(keyring_chunk_size(k), 131072);
        assert_int_equal(keyring_image_size(k), UINT64_C(1) << 30);
        assert_null(keyring_free(k));

        assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
        assert_int_equal(sql_int(db, "PRAGMA application_id"), 1230197297);
        assert_int_equal(sql_int(db, "PRAGMA user_version"), 1);
        assert_int_equal(sql_int(db, "SELECT value FROM meta WHERE name = 'chunk_size'"), 131072);
        assert_int_equal(sql_int(db, "SELECT value FROM meta WHERE name = 'image_size'"), INT64_C(1) << 30);
        assert_int_equal(sql_int(db, "SELECT count(*) FROM meta"), 2);
        assert_int_equal(sql_int(db, "SELECT count(*) FROM sqlite_master WHERE type = 'table'"), 2);
        /* Column names, types, primary key and NOT NULL exactly as the format says. */
        assert_int_equal(sqlite3_prepare_v2(db, "SELECT name, type, \"notnull\", pk FROM pragma_table_info('chunks') ORDER BY cid",
                                            -1, &stmt, NULL),
                         SQLITE_OK);
        {
                static const char *const expected[][2] = { { "idx", "INTEGER" }, { "tag", "BLOB" }, { "wkey", "BLOB" }, { "flags", "INTEGER" } };

                for (int i = 0; i < 4; i++) {
                        assert_int_equal(sqlite3_step(stmt), SQLITE_ROW);
                        assert_string_equal(sqlite3_column_text(stmt, 0), expected[i][0]);
                        assert_string_equal(sqlite3_column_text(stmt, 1), expected[i][1]);
                        assert_int_equal(sqlite3_column_int(stmt, 2), i == 0 ? 0 : 1);
                        assert_int_equal(sqlite3_column_int(stmt, 3), i == 0 ? 1 : 0);
                }
                assert_int_equal(sqlite3_step(stmt), SQLITE_DONE);
        }
        sqlite3_finalize(stmt);
        /* The CHECK constraints hold. */
        assert_int_not_equal(sqlite3_exec(db, "INSERT INTO chunks VALUES (1, zeroblob(31), zeroblob(40), 0)", NULL, NULL, NULL), SQLITE_OK);
        assert_int_not_equal(sqlite3_exec(db, "INSERT INTO chunks VALUES (1, zeroblob(32), zeroblob(41), 0)", NULL, NULL, NULL), SQLITE_OK);
        assert_int_not_equal(sqlite3_exec(db, "INSERT INTO chunks VALUES (1, zeroblob(32), zeroblob(40), 256)", NULL, NULL, NULL), SQLITE_OK);
        assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &stmt, NULL), SQLITE_OK);
        assert_int_equal(sqlite3_step(stmt), SQLITE_ROW);
        journal = strdup((const char *) sqlite3_column_text(stmt, 0));
        sqlite3_finalize(stmt);
        assert_string_equal(journal, "wal");
        free(journal);
        sqlite3_close(db);

        assert_int_equal(keyring_create(f->path, 131072, 0, &k), -EEXIST);
        assert_int_equal(keyring_create("/tmp/x.db", 1000, 0, &k), -EINVAL);
}

static void test_put_get_delete(void **state) {
        Fixture *f = *state;
        Keyring *k = NULL;
        KeyringRecord rec, back;
        KeyringIterator *it = NULL;
        uint64_t count = 99, expect_idx[] = { 0, 2, 8 };
        int i = 0;

        assert_int_equal(keyring_create(f->path, 4096, 9 * 4096 - 1, &k), 0);
        assert_int_equal(keyring_get(k, 0, &back), -ENOENT);
        assert_int_equal(keyring_count(k, &count), 0);
        assert_int_equal(count, 0);

        make_record(8, 1, &rec);
        assert_int_equal(keyring_put(k, &rec), 0);
        make_record(0, 0, &rec);
        assert_int_equal(keyring_put(k, &rec), 0);
        make_record(2, 1, &rec);
        assert_int_equal(keyring_put(k, &rec), 0);
        assert_int_equal(keyring_get(k, 2, &back), 0);
        assert_record_equal(&back, &rec);

        /* Replacing a record. */
        rec.tag[5] ^= 0xff;
        rec.flags = 0;
        assert_int_equal(keyring_put(k, &rec), 0);
        assert_int_equal(keyring_get(k, 2, &back), 0);
        assert_record_equal(&back, &rec);
        assert_int_equal(keyring_count(k, &count), 0);
        assert_int_equal(count, 3);

        /* Out of range and reserved flags are refused. */
        make_record(9, 0, &rec);
        assert_int_equal(keyring_put(k, &rec), -EINVAL);
        make_record(1, 2, &rec);
        assert_int_equal(keyring_put(k, &rec), -EINVAL);

        assert_int_equal(keyring_iterator_new(k, &it), 0);
        while (keyring_iterator_next(it, &back) > 0)
                assert_int_equal(back.idx, expect_idx[i++]);
        assert_int_equal(i, 3);
        assert_null(keyring_iterator_free(it));

        assert_int_equal(keyring_delete(k, 2), 1);
        assert_int_equal(keyring_delete(k, 2), 0);
        assert_int_equal(keyring_get(k, 2, &back), -ENOENT);
        assert_null(keyring_free(k));

        /* Records survive reopening. */
        assert_int_equal(keyring_open(f->path, &k), 0);
        assert_int_equal(keyring_chunk_size(k), 4096);
        assert_int_equal(keyring_image_size(k), 9 * 4096 - 1);
        assert_int_equal(keyring_get(k, 8, &back), 0);
        make_record(8, 1, &rec);
        assert_record_equal(&back, &rec);
        keyring_free(k);
        assert_null(keyring_free(NULL));
}

static void test_import_export(void **state) {
        Fixture *f = *state;
        Keyring *k = NULL;
        uint8_t *stream = NULL, *out = NULL, digest[32], expected[32];
        size_t len, out_len;
        uint64_t digest_len = 0;
        KeyringRecord rec;
        char empty[160];

        make_stream(&stream, &len);
        assert_int_equal(keyring_create(f->path, 131072, 1 << 20, &k), 0);
        make_record(7, 0, &rec);
        assert_int_equal(keyring_put(k, &rec), 0);

        assert_int_equal(keyring_import_stream(k, stream, len), 0);
        assert_int_equal(keyring_chunk_size(k), 4096);
        assert_int_equal(keyring_image_size(k), 10 * 4096 - 512);
        assert_int_equal(keyring_get(k, 7, &rec), -ENOENT);     /* import replaces everything */
        assert_int_equal(keyring_export_stream(k, &out, &out_len), 0);
        assert_int_equal(out_len, len);
        assert_memory_equal(out, stream, len);
        assert_int_equal(keyring_digest(k, digest, &digest_len), 0);
        assert_int_equal(crypto_sha256(stream, len, expected), 0);
        assert_memory_equal(digest, expected, 32);
        assert_int_equal(digest_len, len);
        free(out);
        out = NULL;
        assert_null(keyring_free(k));

        /* The imported meta is what a reopen sees. */
        assert_int_equal(keyring_open(f->path, &k), 0);
        assert_int_equal(keyring_chunk_size(k), 4096);
        assert_int_equal(keyring_export_stream(k, &out, &out_len), 0);
        assert_memory_equal(out, stream, len);
        free(out);

        /* A bad stream changes nothing. */
        stream[len - 81 + 7] = 1;     /* last index 9 → 1: unsorted */
        assert_int_equal(keyring_import_stream(k, stream, len), -EBADMSG);
        assert_int_equal(keyring_get(k, 9, &rec), 0);
        assert_int_equal(keyring_chunk_size(k), 4096);
        keyring_free(k);
        free(stream);

        /* An empty keyring exports a bare header. */
        snprintf(empty, sizeof(empty), "%s/empty.db", f->dir);
        assert_int_equal(keyring_create(empty, 131072, 512, &k), 0);
        assert_int_equal(keyring_export_stream(k, &out, &out_len), 0);
        assert_int_equal(out_len, KEYRING_STREAM_HEADER_LEN);
        free(out);
        keyring_free(k);
}

static void test_open_rejects(void **state) {
        Fixture *f = *state;
        Keyring *k = NULL;
        char other[160];
        FILE *fp;

        assert_int_equal(keyring_open(f->path, &k), -ENOENT);
        assert_null(k);

        /* An sqlite database that is not a keyring. */
        sql_exec(f->path, "CREATE TABLE t (x)");
        assert_int_equal(keyring_open(f->path, &k), -EBADMSG);
        assert_int_equal(keyring_create(f->path, 4096, 0, &k), -EEXIST);

        /* Wrong user_version, missing and invalid meta. */
        snprintf(other, sizeof(other), "%s/k2.db", f->dir);
        assert_int_equal(keyring_create(other, 4096, 4096, &k), 0);
        keyring_free(k);
        sql_exec(other, "PRAGMA user_version = 2");
        assert_int_equal(keyring_open(other, &k), -EBADMSG);
        sql_exec(other, "PRAGMA user_version = 1; UPDATE meta SET value = 5000 WHERE name = 'chunk_size'");
        assert_int_equal(keyring_open(other, &k), -EBADMSG);
        sql_exec(other, "UPDATE meta SET value = 4096 WHERE name = 'chunk_size'; UPDATE meta SET value = -1 WHERE name = 'image_size'");
        assert_int_equal(keyring_open(other, &k), -EBADMSG);
        sql_exec(other, "DELETE FROM meta WHERE name = 'image_size'");
        assert_int_equal(keyring_open(other, &k), -EBADMSG);
        sql_exec(other, "INSERT INTO meta VALUES ('image_size', 8192)");
        assert_int_equal(keyring_open(other, &k), 0);
        keyring_free(k);

        /* Tables with other columns than the format's. */
        sql_exec(other, "ALTER TABLE chunks ADD COLUMN extra INTEGER");
        assert_int_equal(keyring_open(other, &k), -EBADMSG);
        sql_exec(other, "ALTER TABLE chunks DROP COLUMN extra");
        assert_int_equal(keyring_open(other, &k), 0);
        keyring_free(k);

        /* A stored record that breaks the stream rules is reported, not exported. */
        sql_exec(other, "INSERT INTO chunks VALUES (5, zeroblob(32), zeroblob(40), 0)");
        assert_int_equal(keyring_open(other, &k), 0);
        {
                uint8_t *out = NULL, digest[32];
                size_t out_len;
                uint64_t dl;
                KeyringRecord rec;

                assert_int_equal(keyring_export_stream(k, &out, &out_len), -EBADMSG);
                assert_null(out);
                assert_int_equal(keyring_digest(k, digest, &dl), -EBADMSG);
                assert_int_equal(keyring_get(k, 5, &rec), -EBADMSG);
        }
        keyring_free(k);

        /* Not a database at all. */
        snprintf(other, sizeof(other), "%s/garbage.db", f->dir);
        fp = fopen(other, "w");
        assert_non_null(fp);
        for (int i = 0; i < 1000; i++)
                fputs("not a database ", fp);
        fclose(fp);
        assert_int_not_equal(keyring_open(other, &k), 0);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_wrap_unwrap),
                cmocka_unit_test(test_stream_round_trip),
                cmocka_unit_test(test_stream_rejects),
                cmocka_unit_test_setup_teardown(test_schema, setup, teardown),
                cmocka_unit_test_setup_teardown(test_put_get_delete, setup, teardown),
                cmocka_unit_test_setup_teardown(test_import_export, setup, teardown),
                cmocka_unit_test_setup_teardown(test_open_rejects, setup, teardown),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
