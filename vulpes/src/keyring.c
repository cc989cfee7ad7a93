/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Keyrings (doc/parcel-format.md, "Keyrings"): wrapping chunk keys under the parcel key, the canonical
 * keyring stream, and the local sqlite keyring database, with vulpes's own tables in it (changed chunks,
 * pending uploads; doc/vulpes.md).  With cache.c (its index), the only file that includes sqlite3.
 *
 * The database is in WAL mode with synchronous=FULL, so a committed record survives a crash.  Streams are
 * validated completely before anything is written, and an import is one transaction.
 *
 * Threading: the stream and key functions are pure and safe from any thread.  A Keyring (and its
 * iterators) must be used by one thread at a time; the connection is opened without sqlite's own mutex.
 */
#include "keyring.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sqlite3.h>

#include "chunk.h"
#include "crypto.h"
#include "log.h"

static const uint8_t stream_magic[4] = { 'I', 'S', 'R', 'K' };
static const char keywrap_label[] = "isr-keywrap-v1";

enum {
        STREAM_FORMAT_VERSION = 1,
        KEYRING_APPLICATION_ID = 0x49535231,     /* "ISR1" */
        KEYRING_USER_VERSION = 1,
        KEYRING_BUSY_TIMEOUT_MS = 10000,
};

static const char schema_sql[] =
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);\n"
        "CREATE TABLE chunks (\n"
        "    idx   INTEGER PRIMARY KEY,\n"
        "    tag   BLOB NOT NULL CHECK (length(tag) = 32),\n"
        "    wkey  BLOB NOT NULL CHECK (length(wkey) = 40),\n"
        "    flags INTEGER NOT NULL CHECK (flags BETWEEN 0 AND 255)\n"
        ");\n";

struct Keyring {
        sqlite3 *db;
        char *path;
        uint32_t chunk_size;
        uint64_t image_size;
        sqlite3_stmt *get_stmt;
        sqlite3_stmt *put_stmt;
        sqlite3_stmt *delete_stmt;
};

struct KeyringIterator {
        Keyring *keyring;
        sqlite3_stmt *stmt;
};

/* --- chunk keys ------------------------------------------------------------------------------------ */

static int keywrap_key_derive(const uint8_t parcel_key[KEYRING_PARCEL_KEY_LEN], uint8_t ret_kw[CRYPTO_KEY_LEN]) {
        const CryptoBuffer label = { keywrap_label, sizeof(keywrap_label) - 1 };

        return crypto_hmac_sha256(parcel_key, KEYRING_PARCEL_KEY_LEN, &label, 1, ret_kw);
}

int keyring_wrap_key(const uint8_t parcel_key[KEYRING_PARCEL_KEY_LEN], const uint8_t key[KEYRING_KEY_LEN],
                     uint8_t ret_wkey[KEYRING_WKEY_LEN]) {
        uint8_t kw[CRYPTO_KEY_LEN];
        int r;

        r = keywrap_key_derive(parcel_key, kw);
        if (r >= 0)
                r = crypto_aes256_keywrap(kw, key, KEYRING_KEY_LEN, ret_wkey);
        crypto_wipe(kw, sizeof(kw));
        return r;
}

int keyring_kw_derive(const uint8_t parcel_key[KEYRING_PARCEL_KEY_LEN], uint8_t ret_kw[KEYRING_KEY_LEN]) {
        return keywrap_key_derive(parcel_key, ret_kw);
}

int keyring_unwrap_key_with(const uint8_t kw[KEYRING_KEY_LEN], const uint8_t wkey[KEYRING_WKEY_LEN],
                            uint8_t ret_key[KEYRING_KEY_LEN]) {
        int r;

        r = crypto_aes256_keyunwrap(kw, wkey, KEYRING_WKEY_LEN, ret_key);
        if (r == -EBADMSG)
                log_debug("failed to unwrap chunk key: altered or wrapped under another parcel key");
        return r;
}

int keyring_unwrap_key(const uint8_t parcel_key[KEYRING_PARCEL_KEY_LEN], const uint8_t wkey[KEYRING_WKEY_LEN],
                       uint8_t ret_key[KEYRING_KEY_LEN]) {
        uint8_t kw[CRYPTO_KEY_LEN];
        int r;

        r = keywrap_key_derive(parcel_key, kw);
        if (r >= 0)
                r = keyring_unwrap_key_with(kw, wkey, ret_key);
        crypto_wipe(kw, sizeof(kw));
        return r;
}

/* --- keyring streams ------------------------------------------------------------------------------- */

static void put_be(uint8_t *p, uint64_t v, int bytes) {
        for (int i = bytes - 1; i >= 0; i--, v >>= 8)
                p[i] = (uint8_t) v;
}

static uint64_t get_be(const uint8_t *p, int bytes) {
        uint64_t v = 0;

        for (int i = 0; i < bytes; i++)
                v = v << 8 | p[i];
        return v;
}

static void stream_header_build(uint8_t h[KEYRING_STREAM_HEADER_LEN], uint32_t chunk_size, uint64_t image_size,
                                uint64_t n_records) {
        memcpy(h, stream_magic, sizeof(stream_magic));
        h[4] = STREAM_FORMAT_VERSION;
        h[5] = h[6] = h[7] = 0;
        put_be(h + 8, chunk_size, 4);
        put_be(h + 12, image_size, 8);
        put_be(h + 20, n_records, 8);
}

static void record_build(uint8_t out[KEYRING_RECORD_LEN], const KeyringRecord *rec) {
        put_be(out, rec->idx, 8);
        out[8] = rec->flags;
        memcpy(out + 9, rec->tag, KEYRING_TAG_LEN);
        memcpy(out + 9 + KEYRING_TAG_LEN, rec->wkey, KEYRING_WKEY_LEN);
}

/* Checks one record against the previous index (has_prev false for the first); 0 or -EBADMSG. */
static int record_check(const KeyringRecord *rec, bool has_prev, uint64_t prev_idx, uint64_t n_chunks) {
        if (has_prev && rec->idx <= prev_idx) {
                log_debug("failed to accept keyring record: index %llu after %llu", (unsigned long long) rec->idx,
                          (unsigned long long) prev_idx);
                return -EBADMSG;
        }
        if (rec->idx >= n_chunks) {
                log_debug("failed to accept keyring record: index %llu beyond the image's %llu chunks",
                          (unsigned long long) rec->idx, (unsigned long long) n_chunks);
                return -EBADMSG;
        }
        if (rec->flags & ~KEYRING_FLAGS_VALID) {
                log_debug("failed to accept keyring record: reserved flag bits set in 0x%02x", rec->flags);
                return -EBADMSG;
        }
        return 0;
}

int keyring_stream_encode(uint32_t chunk_size, uint64_t image_size, const KeyringRecord *records, size_t n_records,
                          uint8_t **ret_stream, size_t *ret_len) {
        uint64_t n_chunks;
        uint8_t *stream;
        size_t len;

        if (!chunk_size_valid(chunk_size))
                return -EINVAL;
        n_chunks = chunk_count(image_size, chunk_size);
        for (size_t i = 0; i < n_records; i++)
                if (record_check(&records[i], i > 0, i > 0 ? records[i - 1].idx : 0, n_chunks) < 0)
                        return -EINVAL;
        if (n_records > (SIZE_MAX - KEYRING_STREAM_HEADER_LEN) / KEYRING_RECORD_LEN)
                return -ENOMEM;

        len = KEYRING_STREAM_HEADER_LEN + n_records * KEYRING_RECORD_LEN;
        stream = malloc(len);
        if (!stream)
                return -ENOMEM;
        stream_header_build(stream, chunk_size, image_size, n_records);
        for (size_t i = 0; i < n_records; i++)
                record_build(stream + KEYRING_STREAM_HEADER_LEN + i * KEYRING_RECORD_LEN, &records[i]);
        *ret_stream = stream;
        *ret_len = len;
        return 0;
}

int keyring_stream_decode(const void *stream, size_t len, uint32_t *ret_chunk_size, uint64_t *ret_image_size,
                          KeyringRecord **ret_records, size_t *ret_n_records) {
        const uint8_t *s = stream;
        KeyringRecord *records = NULL;
        uint64_t chunk_size, image_size, n_records, n_chunks;
        int r;

        if (len < KEYRING_STREAM_HEADER_LEN) {
                log_debug("failed to decode keyring stream: %zu bytes is shorter than its header", len);
                return -EBADMSG;
        }
        if (memcmp(s, stream_magic, sizeof(stream_magic)) != 0 || s[4] != STREAM_FORMAT_VERSION || s[5] != 0 ||
            s[6] != 0 || s[7] != 0) {
                log_debug("failed to decode keyring stream: bad magic, version or reserved bytes");
                return -EBADMSG;
        }
        chunk_size = get_be(s + 8, 4);
        image_size = get_be(s + 12, 8);
        n_records = get_be(s + 20, 8);
        if (!chunk_size_valid(chunk_size)) {
                log_debug("failed to decode keyring stream: invalid chunk size %llu", (unsigned long long) chunk_size);
                return -EBADMSG;
        }
        if ((len - KEYRING_STREAM_HEADER_LEN) % KEYRING_RECORD_LEN != 0 ||
            (len - KEYRING_STREAM_HEADER_LEN) / KEYRING_RECORD_LEN != n_records) {
                log_debug("failed to decode keyring stream: %zu bytes do not hold %llu records", len,
                          (unsigned long long) n_records);
                return -EBADMSG;
        }

        if (n_records > 0) {
                records = calloc(n_records, sizeof(*records));
                if (!records)
                        return -ENOMEM;
        }
        n_chunks = chunk_count(image_size, (uint32_t) chunk_size);
        for (size_t i = 0; i < n_records; i++) {
                const uint8_t *p = s + KEYRING_STREAM_HEADER_LEN + i * KEYRING_RECORD_LEN;

                records[i].idx = get_be(p, 8);
                records[i].flags = p[8];
                memcpy(records[i].tag, p + 9, KEYRING_TAG_LEN);
                memcpy(records[i].wkey, p + 9 + KEYRING_TAG_LEN, KEYRING_WKEY_LEN);
                r = record_check(&records[i], i > 0, i > 0 ? records[i - 1].idx : 0, n_chunks);
                if (r < 0)
                        goto out_records;
        }

        *ret_chunk_size = (uint32_t) chunk_size;
        *ret_image_size = image_size;
        *ret_records = records;
        *ret_n_records = n_records;
        return 0;

out_records:
        free(records);
        return r;
}

/* --- the local keyring database -------------------------------------------------------------------- */

static int sqlite_failure(Keyring *k, const char *what) {
        log_error("failed to %s keyring %s: %s", what, k->path, sqlite3_errmsg(k->db));
        return -EIO;
}

static int exec_sql(Keyring *k, const char *sql, const char *what) {
        if (sqlite3_exec(k->db, sql, NULL, NULL, NULL) != SQLITE_OK)
                return sqlite_failure(k, what);
        return 0;
}

/* Runs a statement that yields one integer (a pragma or a count). */
static int query_int64(Keyring *k, const char *sql, int64_t *ret) {
        sqlite3_stmt *stmt = NULL;
        int r = 0;

        if (sqlite3_prepare_v2(k->db, sql, -1, &stmt, NULL) != SQLITE_OK)
                return sqlite_failure(k, "query");
        if (sqlite3_step(stmt) != SQLITE_ROW) {
                r = sqlite_failure(k, "query");
                goto out_stmt;
        }
        *ret = sqlite3_column_int64(stmt, 0);
out_stmt:
        sqlite3_finalize(stmt);
        return r;
}

Keyring *keyring_free(Keyring *k) {
        if (!k)
                return NULL;
        sqlite3_finalize(k->get_stmt);
        sqlite3_finalize(k->put_stmt);
        sqlite3_finalize(k->delete_stmt);
        if (k->db && sqlite3_close(k->db) != SQLITE_OK)
                log_error("failed to close keyring %s: %s", k->path, sqlite3_errmsg(k->db));
        free(k->path);
        free(k);
        return NULL;
}

static int keyring_connect(const char *path, int open_flags, Keyring **ret) {
        Keyring *k;
        int rc, r;

        k = calloc(1, sizeof(*k));
        if (!k)
                return -ENOMEM;
        k->path = strdup(path);
        if (!k->path) {
                r = -ENOMEM;
                goto out_free;
        }
        rc = sqlite3_open_v2(path, &k->db, open_flags | SQLITE_OPEN_NOMUTEX, NULL);
        if (rc != SQLITE_OK) {
                if (rc == SQLITE_CANTOPEN && !(open_flags & SQLITE_OPEN_CREATE) && access(path, F_OK) < 0) {
                        r = -ENOENT;
                        log_error("failed to open keyring %s: %s", path, strerror(-r));
                } else {
                        r = sqlite_failure(k, "open");
                }
                goto out_free;
        }
        sqlite3_extended_result_codes(k->db, 1);
        sqlite3_busy_timeout(k->db, KEYRING_BUSY_TIMEOUT_MS);
        *ret = k;
        return 0;

out_free:
        keyring_free(k);
        return r;
}

/* Switches to WAL with synchronous=FULL; journal_mode cannot change inside a transaction. */
static int keyring_configure(Keyring *k) {
        sqlite3_stmt *stmt = NULL;
        int r = 0;

        if (sqlite3_prepare_v2(k->db, "PRAGMA journal_mode = WAL", -1, &stmt, NULL) != SQLITE_OK ||
            sqlite3_step(stmt) != SQLITE_ROW) {
                r = sqlite_failure(k, "set journal mode of");
                goto out_stmt;
        }
        if (strcmp((const char *) sqlite3_column_text(stmt, 0), "wal") != 0) {
                log_error("failed to set journal mode of keyring %s: got %s", k->path, sqlite3_column_text(stmt, 0));
                r = -EIO;
                goto out_stmt;
        }
        r = exec_sql(k, "PRAGMA synchronous = FULL", "configure");
out_stmt:
        sqlite3_finalize(stmt);
        return r;
}

static int keyring_prepare(Keyring *k) {
        if (sqlite3_prepare_v3(k->db, "SELECT idx, flags, tag, wkey FROM chunks WHERE idx = ?1", -1,
                               SQLITE_PREPARE_PERSISTENT, &k->get_stmt, NULL) != SQLITE_OK ||
            sqlite3_prepare_v3(k->db, "INSERT OR REPLACE INTO chunks (idx, tag, wkey, flags) VALUES (?1, ?2, ?3, ?4)",
                               -1, SQLITE_PREPARE_PERSISTENT, &k->put_stmt, NULL) != SQLITE_OK ||
            sqlite3_prepare_v3(k->db, "DELETE FROM chunks WHERE idx = ?1", -1, SQLITE_PREPARE_PERSISTENT,
                               &k->delete_stmt, NULL) != SQLITE_OK) {
                log_error("failed to prepare statements for keyring %s: %s", k->path, sqlite3_errmsg(k->db));
                return -EBADMSG;
        }
        return 0;
}

/* Checks that a table has exactly the format's columns, in order; -EBADMSG if not. */
static int table_check(Keyring *k, const char *table, const char *const *columns, size_t n_columns) {
        sqlite3_stmt *stmt = NULL;
        size_t i = 0;
        int rc, r = 0;

        if (sqlite3_prepare_v2(k->db, "SELECT name FROM pragma_table_info(?1) ORDER BY cid", -1, &stmt, NULL) != SQLITE_OK)
                return sqlite_failure(k, "inspect");
        sqlite3_bind_text(stmt, 1, table, -1, SQLITE_STATIC);
        while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
                const char *name = (const char *) sqlite3_column_text(stmt, 0);

                if (i >= n_columns || !name || strcmp(name, columns[i]) != 0)
                        break;
                i++;
        }
        if (rc != SQLITE_ROW && rc != SQLITE_DONE) {
                r = sqlite_failure(k, "inspect");
        } else if (rc == SQLITE_ROW || i != n_columns) {
                log_error("failed to open keyring %s: table %s does not have the columns of the format", k->path, table);
                r = -EBADMSG;
        }
        sqlite3_finalize(stmt);
        return r;
}

static int tables_check(Keyring *k) {
        static const char *const meta_columns[] = { "name", "value" };
        static const char *const chunks_columns[] = { "idx", "tag", "wkey", "flags" };
        int r;

        r = table_check(k, "meta", meta_columns, 2);
        if (r < 0)
                return r;
        return table_check(k, "chunks", chunks_columns, 4);
}

/* Writes both meta rows; inside the caller's transaction. */
static int meta_write(Keyring *k, uint32_t chunk_size, uint64_t image_size) {
        sqlite3_stmt *stmt = NULL;
        const struct {
                const char *name;
                int64_t value;
        } rows[] = {
                { "chunk_size", chunk_size },
                { "image_size", (int64_t) image_size },
        };
        int r = 0;

        if (sqlite3_prepare_v2(k->db, "INSERT OR REPLACE INTO meta (name, value) VALUES (?1, ?2)", -1, &stmt,
                               NULL) != SQLITE_OK)
                return sqlite_failure(k, "write meta of");
        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
                sqlite3_bind_text(stmt, 1, rows[i].name, -1, SQLITE_STATIC);
                sqlite3_bind_int64(stmt, 2, rows[i].value);
                if (sqlite3_step(stmt) != SQLITE_DONE) {
                        r = sqlite_failure(k, "write meta of");
                        goto out_stmt;
                }
                sqlite3_reset(stmt);
        }
out_stmt:
        sqlite3_finalize(stmt);
        return r;
}

/* Reads and validates meta into k; -EBADMSG if this is not a valid keyring. */
static int meta_read(Keyring *k) {
        sqlite3_stmt *stmt = NULL;
        bool have_chunk_size = false, have_image_size = false;
        int rc, r = 0;

        if (sqlite3_prepare_v2(k->db, "SELECT name, value FROM meta", -1, &stmt, NULL) != SQLITE_OK) {
                log_error("failed to read meta of keyring %s: %s", k->path, sqlite3_errmsg(k->db));
                return -EBADMSG;
        }
        while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
                const char *name = (const char *) sqlite3_column_text(stmt, 0);
                int64_t value = sqlite3_column_int64(stmt, 1);

                if (sqlite3_column_type(stmt, 1) != SQLITE_INTEGER || !name)
                        continue;
                if (strcmp(name, "chunk_size") == 0) {
                        if (!chunk_size_valid((uint64_t) value)) {
                                log_error("failed to open keyring %s: invalid chunk size %lld", k->path,
                                          (long long) value);
                                r = -EBADMSG;
                                goto out_stmt;
                        }
                        k->chunk_size = (uint32_t) value;
                        have_chunk_size = true;
                } else if (strcmp(name, "image_size") == 0) {
                        if (value < 0) {
                                log_error("failed to open keyring %s: invalid image size %lld", k->path,
                                          (long long) value);
                                r = -EBADMSG;
                                goto out_stmt;
                        }
                        k->image_size = (uint64_t) value;
                        have_image_size = true;
                }
        }
        if (rc != SQLITE_DONE) {
                r = sqlite_failure(k, "read meta of");
                goto out_stmt;
        }
        if (!have_chunk_size || !have_image_size) {
                log_error("failed to open keyring %s: meta lacks chunk_size or image_size", k->path);
                r = -EBADMSG;
        }
out_stmt:
        sqlite3_finalize(stmt);
        return r;
}

int keyring_create(const char *path, uint32_t chunk_size, uint64_t image_size, Keyring **ret) {
        char pragmas[128];
        struct stat st;
        Keyring *k = NULL;
        int64_t objects = 0, application_id = 0;
        int r;

        if (!chunk_size_valid(chunk_size) || image_size > KEYRING_IMAGE_SIZE_MAX)
                return -EINVAL;
        if (stat(path, &st) == 0) {
                log_error("failed to create keyring %s: %s", path, strerror(EEXIST));
                return -EEXIST;
        }

        r = keyring_connect(path, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, &k);
        if (r < 0)
                return r;
        r = keyring_configure(k);
        if (r < 0)
                goto out_unlink;
        r = exec_sql(k, "BEGIN IMMEDIATE", "begin creating");
        if (r < 0)
                goto out_unlink;
        /* Another process may have created it since the stat() above. */
        r = query_int64(k, "SELECT count(*) FROM sqlite_master", &objects);
        if (r < 0)
                goto out_rollback;
        r = query_int64(k, "PRAGMA application_id", &application_id);
        if (r < 0)
                goto out_rollback;
        if (objects != 0 || application_id != 0) {
                log_error("failed to create keyring %s: %s", path, strerror(EEXIST));
                r = -EEXIST;
                goto out_rollback;
        }
        snprintf(pragmas, sizeof(pragmas), "PRAGMA application_id = %d; PRAGMA user_version = %d;",
                 KEYRING_APPLICATION_ID, KEYRING_USER_VERSION);
        r = exec_sql(k, pragmas, "initialize");
        if (r < 0)
                goto out_rollback;
        r = exec_sql(k, schema_sql, "create tables of");
        if (r < 0)
                goto out_rollback;
        r = meta_write(k, chunk_size, image_size);
        if (r < 0)
                goto out_rollback;
        r = exec_sql(k, "COMMIT", "commit");
        if (r < 0)
                goto out_rollback;

        k->chunk_size = chunk_size;
        k->image_size = image_size;
        r = keyring_prepare(k);
        if (r < 0)
                goto out_free;
        *ret = k;
        return 0;

out_rollback:
        sqlite3_exec(k->db, "ROLLBACK", NULL, NULL, NULL);
out_unlink:
        if (r != -EEXIST) {
                /* Remove what this call created, so that a retry can create it afresh. */
                char aux[PATH_MAX + 8];

                unlink(path);
                snprintf(aux, sizeof(aux), "%s-wal", path);
                unlink(aux);
                snprintf(aux, sizeof(aux), "%s-shm", path);
                unlink(aux);
        }
out_free:
        keyring_free(k);
        return r;
}

int keyring_open(const char *path, Keyring **ret) {
        Keyring *k = NULL;
        int64_t application_id = 0, user_version = 0;
        int r;

        r = keyring_connect(path, SQLITE_OPEN_READWRITE, &k);
        if (r < 0)
                return r;
        /* Check the identity before anything writes (journal_mode = WAL writes the header). */
        if (query_int64(k, "PRAGMA application_id", &application_id) < 0 ||
            query_int64(k, "PRAGMA user_version", &user_version) < 0) {
                r = -EBADMSG;
                goto out_free;
        }
        if (application_id != KEYRING_APPLICATION_ID || user_version != KEYRING_USER_VERSION) {
                log_error("failed to open keyring %s: application_id 0x%llx, user_version %lld is not a keyring",
                          path, (unsigned long long) application_id, (long long) user_version);
                r = -EBADMSG;
                goto out_free;
        }
        r = keyring_configure(k);
        if (r < 0)
                goto out_free;
        r = tables_check(k);
        if (r < 0)
                goto out_free;
        r = meta_read(k);
        if (r < 0)
                goto out_free;
        r = keyring_prepare(k);
        if (r < 0)
                goto out_free;
        *ret = k;
        return 0;

out_free:
        keyring_free(k);
        return r;
}

uint32_t keyring_chunk_size(const Keyring *k) {
        return k->chunk_size;
}

uint64_t keyring_image_size(const Keyring *k) {
        return k->image_size;
}

/* Reads the row a statement is on (columns idx, flags, tag, wkey); -EBADMSG if it is not a valid record. */
static int record_from_row(Keyring *k, sqlite3_stmt *stmt, KeyringRecord *ret) {
        int64_t idx = sqlite3_column_int64(stmt, 0), flags = sqlite3_column_int64(stmt, 1);
        const void *tag = sqlite3_column_blob(stmt, 2);
        int tag_len = sqlite3_column_bytes(stmt, 2);
        const void *wkey = sqlite3_column_blob(stmt, 3);
        int wkey_len = sqlite3_column_bytes(stmt, 3);

        if (idx < 0 || (uint64_t) idx >= chunk_count(k->image_size, k->chunk_size) ||
            sqlite3_column_type(stmt, 1) != SQLITE_INTEGER || flags < 0 || (flags & ~(int64_t) KEYRING_FLAGS_VALID) ||
            sqlite3_column_type(stmt, 2) != SQLITE_BLOB || tag_len != KEYRING_TAG_LEN ||
            sqlite3_column_type(stmt, 3) != SQLITE_BLOB || wkey_len != KEYRING_WKEY_LEN) {
                log_error("failed to read keyring %s: invalid record at index %lld", k->path, (long long) idx);
                return -EBADMSG;
        }
        ret->idx = (uint64_t) idx;
        ret->flags = (uint8_t) flags;
        memcpy(ret->tag, tag, KEYRING_TAG_LEN);
        memcpy(ret->wkey, wkey, KEYRING_WKEY_LEN);
        return 0;
}

int keyring_get(Keyring *k, uint64_t idx, KeyringRecord *ret) {
        int rc, r;

        if (idx > (uint64_t) INT64_MAX)
                return -ENOENT;
        sqlite3_bind_int64(k->get_stmt, 1, (int64_t) idx);
        rc = sqlite3_step(k->get_stmt);
        if (rc == SQLITE_ROW)
                r = record_from_row(k, k->get_stmt, ret);
        else if (rc == SQLITE_DONE)
                r = -ENOENT;
        else
                r = sqlite_failure(k, "read");
        sqlite3_reset(k->get_stmt);
        return r;
}

static int record_insert(Keyring *k, const KeyringRecord *record) {
        int r = 0;

        sqlite3_bind_int64(k->put_stmt, 1, (int64_t) record->idx);
        sqlite3_bind_blob(k->put_stmt, 2, record->tag, KEYRING_TAG_LEN, SQLITE_STATIC);
        sqlite3_bind_blob(k->put_stmt, 3, record->wkey, KEYRING_WKEY_LEN, SQLITE_STATIC);
        sqlite3_bind_int(k->put_stmt, 4, record->flags);
        if (sqlite3_step(k->put_stmt) != SQLITE_DONE)
                r = sqlite_failure(k, "write");
        sqlite3_reset(k->put_stmt);
        sqlite3_clear_bindings(k->put_stmt);
        return r;
}

int keyring_put(Keyring *k, const KeyringRecord *record) {
        if (record->idx >= chunk_count(k->image_size, k->chunk_size) || (record->flags & ~KEYRING_FLAGS_VALID)) {
                log_error("failed to write keyring %s: invalid record for index %llu", k->path,
                          (unsigned long long) record->idx);
                return -EINVAL;
        }
        return record_insert(k, record);
}

int keyring_delete(Keyring *k, uint64_t idx) {
        int r;

        if (idx > (uint64_t) INT64_MAX)
                return 0;
        sqlite3_bind_int64(k->delete_stmt, 1, (int64_t) idx);
        if (sqlite3_step(k->delete_stmt) != SQLITE_DONE)
                r = sqlite_failure(k, "delete from");
        else
                r = sqlite3_changes(k->db) > 0;
        sqlite3_reset(k->delete_stmt);
        return r;
}

int keyring_count(Keyring *k, uint64_t *ret_count) {
        int64_t n = 0;
        int r;

        r = query_int64(k, "SELECT count(*) FROM chunks", &n);
        if (r < 0)
                return r;
        *ret_count = (uint64_t) n;
        return 0;
}

int keyring_iterator_new(Keyring *k, KeyringIterator **ret) {
        KeyringIterator *it;

        it = calloc(1, sizeof(*it));
        if (!it)
                return -ENOMEM;
        it->keyring = k;
        if (sqlite3_prepare_v2(k->db, "SELECT idx, flags, tag, wkey FROM chunks ORDER BY idx", -1, &it->stmt,
                               NULL) != SQLITE_OK) {
                free(it);
                return sqlite_failure(k, "iterate over");
        }
        *ret = it;
        return 0;
}

int keyring_iterator_next(KeyringIterator *it, KeyringRecord *ret) {
        int rc, r;

        rc = sqlite3_step(it->stmt);
        if (rc == SQLITE_DONE)
                return 0;
        if (rc != SQLITE_ROW)
                return sqlite_failure(it->keyring, "iterate over");
        r = record_from_row(it->keyring, it->stmt, ret);
        return r < 0 ? r : 1;
}

KeyringIterator *keyring_iterator_free(KeyringIterator *it) {
        if (!it)
                return NULL;
        sqlite3_finalize(it->stmt);
        free(it);
        return NULL;
}

int keyring_import_stream(Keyring *k, const void *stream, size_t len) {
        KeyringRecord *records = NULL;
        size_t n_records = 0;
        uint64_t image_size;
        uint32_t chunk_size;
        int r;

        r = keyring_stream_decode(stream, len, &chunk_size, &image_size, &records, &n_records);
        if (r < 0)
                return r;
        if (image_size > KEYRING_IMAGE_SIZE_MAX) {
                log_error("failed to import into keyring %s: image size %llu above the limit", k->path,
                          (unsigned long long) image_size);
                r = -ERANGE;
                goto out_records;
        }

        r = exec_sql(k, "BEGIN IMMEDIATE", "begin import into");
        if (r < 0)
                goto out_records;
        r = exec_sql(k, "DELETE FROM chunks", "clear");
        if (r < 0)
                goto out_rollback;
        r = meta_write(k, chunk_size, image_size);
        if (r < 0)
                goto out_rollback;
        for (size_t i = 0; i < n_records; i++) {
                r = record_insert(k, &records[i]);
                if (r < 0)
                        goto out_rollback;
        }
        r = exec_sql(k, "COMMIT", "commit import into");
        if (r < 0)
                goto out_rollback;
        k->chunk_size = chunk_size;
        k->image_size = image_size;
        goto out_records;

out_rollback:
        sqlite3_exec(k->db, "ROLLBACK", NULL, NULL, NULL);
out_records:
        free(records);
        return r;
}

/* Emits the canonical stream piece by piece to a sink; one read transaction gives a consistent snapshot. */
typedef int (*StreamSink)(const void *data, size_t len, void *userdata);

static int stream_emit(Keyring *k, StreamSink sink, void *userdata, uint64_t *ret_n_records) {
        uint8_t header[KEYRING_STREAM_HEADER_LEN], buf[KEYRING_RECORD_LEN];
        KeyringIterator *it = NULL;
        KeyringRecord rec;
        uint64_t n_records = 0, emitted = 0, prev = 0;
        int r;

        r = exec_sql(k, "BEGIN", "begin reading");
        if (r < 0)
                return r;
        r = keyring_count(k, &n_records);
        if (r < 0)
                goto out_commit;
        stream_header_build(header, k->chunk_size, k->image_size, n_records);
        r = sink(header, sizeof(header), userdata);
        if (r < 0)
                goto out_commit;

        r = keyring_iterator_new(k, &it);
        if (r < 0)
                goto out_commit;
        while ((r = keyring_iterator_next(it, &rec)) > 0) {
                /* ORDER BY on the primary key yields strictly increasing indices; checked all the same. */
                if (emitted > 0 && rec.idx <= prev) {
                        r = -EBADMSG;
                        break;
                }
                record_build(buf, &rec);
                r = sink(buf, sizeof(buf), userdata);
                if (r < 0)
                        break;
                prev = rec.idx;
                emitted++;
        }
        if (r == 0 && emitted != n_records) {
                log_error("failed to export keyring %s: %llu records, expected %llu", k->path,
                          (unsigned long long) emitted, (unsigned long long) n_records);
                r = -EIO;
        }
        if (r == 0)
                *ret_n_records = n_records;
        keyring_iterator_free(it);
out_commit:
        sqlite3_exec(k->db, "COMMIT", NULL, NULL, NULL);
        return r;
}

typedef struct StreamBuffer {
        uint8_t *data;
        size_t len;
        size_t capacity;
} StreamBuffer;

static int buffer_sink(const void *data, size_t len, void *userdata) {
        StreamBuffer *b = userdata;

        if (b->len + len > b->capacity) {
                size_t capacity = b->capacity ? b->capacity * 2 : 4096;
                uint8_t *p;

                while (capacity < b->len + len)
                        capacity *= 2;
                p = realloc(b->data, capacity);
                if (!p)
                        return -ENOMEM;
                b->data = p;
                b->capacity = capacity;
        }
        memcpy(b->data + b->len, data, len);
        b->len += len;
        return 0;
}

int keyring_export_stream(Keyring *k, uint8_t **ret_stream, size_t *ret_len) {
        StreamBuffer b = { 0 };
        uint64_t n_records;
        int r;

        r = stream_emit(k, buffer_sink, &b, &n_records);
        if (r < 0) {
                free(b.data);
                return r;
        }
        *ret_stream = b.data;
        *ret_len = b.len;
        return 0;
}

static int digest_sink(const void *data, size_t len, void *userdata) {
        return crypto_sha256_update(userdata, data, len);
}

int keyring_digest(Keyring *k, uint8_t ret_digest[KEYRING_DIGEST_LEN], uint64_t *ret_stream_len) {
        CryptoSha256 *sha = NULL;
        uint64_t n_records;
        int r;

        r = crypto_sha256_new(&sha);
        if (r < 0)
                return r;
        r = stream_emit(k, digest_sink, sha, &n_records);
        if (r < 0)
                goto out_sha;
        r = crypto_sha256_final(sha, ret_digest);
        if (r < 0)
                goto out_sha;
        *ret_stream_len = KEYRING_STREAM_HEADER_LEN + n_records * KEYRING_RECORD_LEN;
out_sha:
        crypto_sha256_free(sha);
        return r;
}

/* --- vulpes's own tables ----------------------------------------------------------------------------- */

int keyring_state_init(Keyring *k) {
        return exec_sql(k,
                        "CREATE TABLE IF NOT EXISTS vulpes_changed (idx INTEGER PRIMARY KEY);\n"
                        "CREATE TABLE IF NOT EXISTS vulpes_uploads (tag BLOB PRIMARY KEY CHECK (length(tag) = 32)) "
                        "WITHOUT ROWID;\n",
                        "create vulpes tables in");
}

int keyring_apply(Keyring *k, const KeyringChange *changes, size_t n) {
        sqlite3_stmt *changed = NULL, *upload = NULL;
        int r;

        if (n == 0)
                return 0;
        if (sqlite3_prepare_v2(k->db, "INSERT OR IGNORE INTO vulpes_changed (idx) VALUES (?1)", -1, &changed, NULL) !=
                    SQLITE_OK ||
            sqlite3_prepare_v2(k->db, "INSERT OR IGNORE INTO vulpes_uploads (tag) VALUES (?1)", -1, &upload, NULL) !=
                    SQLITE_OK) {
                r = sqlite_failure(k, "prepare a flush of");
                goto out_stmts;
        }
        r = exec_sql(k, "BEGIN IMMEDIATE", "begin a flush of");
        if (r < 0)
                goto out_stmts;
        for (size_t i = 0; i < n; i++) {
                const KeyringChange *c = &changes[i];

                if (c->remove) {
                        r = keyring_delete(k, c->record.idx);
                } else {
                        r = keyring_put(k, &c->record);
                        if (r >= 0) {
                                sqlite3_bind_blob(upload, 1, c->record.tag, KEYRING_TAG_LEN, SQLITE_STATIC);
                                if (sqlite3_step(upload) != SQLITE_DONE)
                                        r = sqlite_failure(k, "write");
                                sqlite3_reset(upload);
                        }
                }
                if (r < 0)
                        goto out_rollback;
                sqlite3_bind_int64(changed, 1, (int64_t) c->record.idx);
                if (sqlite3_step(changed) != SQLITE_DONE) {
                        r = sqlite_failure(k, "write");
                        goto out_rollback;
                }
                sqlite3_reset(changed);
        }
        r = exec_sql(k, "COMMIT", "commit a flush of");
        if (r < 0)
                goto out_rollback;
        goto out_stmts;

out_rollback:
        sqlite3_exec(k->db, "ROLLBACK", NULL, NULL, NULL);
out_stmts:
        sqlite3_finalize(changed);
        sqlite3_finalize(upload);
        return r < 0 ? r : 0;
}

int keyring_uploads_next(Keyring *k, uint8_t (*ret_tags)[KEYRING_TAG_LEN], size_t max, size_t *ret_n) {
        sqlite3_stmt *stmt = NULL;
        size_t n = 0;
        int rc, r;

        r = exec_sql(k, "DELETE FROM vulpes_uploads WHERE tag NOT IN (SELECT tag FROM chunks)", "prune uploads of");
        if (r < 0)
                return r;
        if (sqlite3_prepare_v2(k->db, "SELECT tag FROM vulpes_uploads LIMIT ?1", -1, &stmt, NULL) != SQLITE_OK)
                return sqlite_failure(k, "read uploads of");
        sqlite3_bind_int64(stmt, 1, (int64_t) max);
        while ((rc = sqlite3_step(stmt)) == SQLITE_ROW && n < max) {
                if (sqlite3_column_bytes(stmt, 0) != KEYRING_TAG_LEN)
                        continue;
                memcpy(ret_tags[n++], sqlite3_column_blob(stmt, 0), KEYRING_TAG_LEN);
        }
        if (rc != SQLITE_DONE && rc != SQLITE_ROW)
                r = sqlite_failure(k, "read uploads of");
        sqlite3_finalize(stmt);
        *ret_n = n;
        return r;
}

int keyring_uploads_done(Keyring *k, const uint8_t (*tags)[KEYRING_TAG_LEN], size_t n) {
        sqlite3_stmt *stmt = NULL;
        int r;

        if (n == 0)
                return 0;
        r = exec_sql(k, "BEGIN IMMEDIATE", "update uploads of");
        if (r < 0)
                return r;
        if (sqlite3_prepare_v2(k->db, "DELETE FROM vulpes_uploads WHERE tag = ?1", -1, &stmt, NULL) != SQLITE_OK) {
                r = sqlite_failure(k, "update uploads of");
                goto out_rollback;
        }
        for (size_t i = 0; i < n; i++) {
                sqlite3_bind_blob(stmt, 1, tags[i], KEYRING_TAG_LEN, SQLITE_STATIC);
                if (sqlite3_step(stmt) != SQLITE_DONE) {
                        r = sqlite_failure(k, "update uploads of");
                        goto out_rollback;
                }
                sqlite3_reset(stmt);
        }
        sqlite3_finalize(stmt);
        return exec_sql(k, "COMMIT", "update uploads of");

out_rollback:
        sqlite3_finalize(stmt);
        sqlite3_exec(k->db, "ROLLBACK", NULL, NULL, NULL);
        return r;
}

int keyring_state_counts(Keyring *k, uint64_t *ret_changed, uint64_t *ret_uploads) {
        int64_t changed = 0, uploads = 0;
        int r;

        r = query_int64(k, "SELECT count(*) FROM vulpes_changed", &changed);
        if (r < 0)
                return r;
        r = query_int64(k, "SELECT count(*) FROM vulpes_uploads", &uploads);
        if (r < 0)
                return r;
        *ret_changed = (uint64_t) changed;
        *ret_uploads = (uint64_t) uploads;
        return 0;
}

int keyring_changed_reset(Keyring *k) {
        return exec_sql(k, "DELETE FROM vulpes_changed", "reset changes of");
}
