/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The persistent chunk cache: ciphertext chunk objects named by tag, shared by every parcel on the
 * machine, so identical chunks are stored once.  The files are the truth; the sqlite index (object sizes,
 * for usage accounting) is a rebuildable summary and is written with synchronous=OFF: after a crash it
 * may miss entries, and a damaged or missing index is rebuilt by walking chunks/ (as cvmfs does).
 *
 * Objects are verified on every read; one that fails is quarantined, never served.  Writes go through a
 * temporary file in dir/tmp and rename(), so a name never points at a half-written file unless a crash
 * hit a non-durable put, and then the next read's verification catches it.
 *
 * Size limit (cache_set_limit()): an evictor thread removes least recently used objects until the
 * cache is below 90 % of the limit.  Last use is recorded in the index in batches (a read only notes the
 * tag in memory), so reads never write sqlite.
 *
 * Room: every new object must fit under the limit and on the file system, whichever is tighter, with
 * the reservations (room held for dirty chunks, whose flush must not fail) and a small floor kept free.
 * A writer that finds no room evicts least recently used unpinned objects itself, at once, and fails with
 * -ENOSPC only when nothing that may be evicted is left (a hoard may evict only what was used before it
 * started).  A write that the file system refuses with ENOSPC anyway (another process took the space)
 * evicts and retries too.  Objects named in the pins table are never evicted: each
 * vulpes pins every object that is its only copy of acknowledged writes (pending uploads) before the object
 * becomes visible under its name (cache_batch_commit()), and unpins it once the server has it.  Eviction
 * selects, deletes rows and unlinks files inside one write transaction, and pinning is a write
 * transaction too, so another process cannot pin a tag between the check and the unlink.  An open file
 * that is unlinked stays readable, so a reader in another process is never disturbed.
 *
 * Threading: every function is safe from any thread (the index has its own mutex); with a limit, one
 * evictor thread.  Several processes may share one cache directory (sqlite WAL, unique temporary names).
 */
#define _GNU_SOURCE
#include "cache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "chunk.h"
#include "file.h"
#include "hex.h"
#include "log.h"

#define TAG_HEX_LEN (CACHE_TAG_LEN * 2)
#define CACHE_OBJECT_MAX (CHUNK_SIZE_MAX + CHUNK_OVERHEAD)
#define DIRECT_ALIGN 4096                /* buffer, offset and length alignment for O_DIRECT reads */

#define ROOM_FLOOR_MIN ((uint64_t) 256 << 10) /* kept free on the file system (the index, its WAL, directories) */
#define ROOM_FLOOR_MAX ((uint64_t) 1 << 20)

enum {
        INDEX_BUSY_TIMEOUT_MS = 10000,
        ROOM_RETRIES = 8,                /* evict-and-retry rounds for a write the file system refuses */
        TMP_MAX_AGE_SECONDS = 3600,      /* older temporary files are leftovers of a crashed writer */
        BATCH_SMALL = 16,                /* up to this many objects, sync file by file instead of syncfs() */
        USES_MAX = 512,                  /* last-use notes kept in memory before they are written */
        EVICT_INTERVAL_MS = 2000,        /* the evictor looks at the size at least this often */
        EVICT_STEP = 64,                 /* objects per eviction transaction */
};

struct Cache {
        char *dir;
        int dir_fd;
        pthread_mutex_t lock;            /* guards index */
        sqlite3 *index;
        sqlite3_stmt *insert_stmt;
        sqlite3_stmt *delete_stmt;
        char *owner;                     /* who pins: the state directory of this vulpes */

        uint8_t (*uses)[CACHE_TAG_LEN];  /* read since the last write of last-use times */
        size_t n_uses;

        /* Room and the evictor, under lock. */
        uint64_t limit;                  /* bytes, 0: none */
        uint64_t bytes_est;              /* the index's total bytes: kept up to date here, re-read when it matters */
        uint64_t reserved;               /* room held by cache_reserve() */
        uint64_t pending;                /* objects being written: counted under the limit until indexed */
        uint64_t refused;                /* writes and reservations refused for lack of room */
        uint64_t evictions;              /* by this process */
        uint64_t put_bytes;              /* since the evictor last looked */
        pthread_t evictor;
        bool evictor_started, stopping, evict_wanted;
        pthread_cond_t evict_cond;
};

typedef struct BatchEntry {
        uint8_t tag[CACHE_TAG_LEN];
        char *tmp_path;
        size_t len;
        bool indexed;
} BatchEntry;

struct CacheBatch {
        Cache *cache;
        bool pin;
        int64_t keep_since;              /* evict only objects used before this for room (0: any) */
        BatchEntry *entries;
        size_t n, capacity;
};

const char *cache_dir(const Cache *c) {
        return c->dir;
}

/* chunks/ab/cd/<hex>, relative to the cache directory. */
static void object_relpath(const uint8_t tag[CACHE_TAG_LEN], char ret[sizeof("chunks/ab/cd/") + TAG_HEX_LEN]) {
        char hex[TAG_HEX_LEN + 1];

        hex_encode(tag, CACHE_TAG_LEN, hex);
        snprintf(ret, sizeof("chunks/ab/cd/") + TAG_HEX_LEN, "chunks/%.2s/%.2s/%s", hex, hex + 2, hex);
}

static int mkdir_p_at(int dir_fd, const char *relpath) {
        char buf[PATH_MAX];

        snprintf(buf, sizeof(buf), "%s", relpath);
        for (char *p = buf + 1; ; p++) {
                if (*p != '/' && *p != 0)
                        continue;
                char saved = *p;

                *p = 0;
                if (mkdirat(dir_fd, buf, 0755) < 0 && errno != EEXIST)
                        return -errno;
                *p = saved;
                if (!saved)
                        break;
        }
        return 0;
}

/* --- index ------------------------------------------------------------------------------------------ */

static int index_exec(Cache *c, const char *sql) {
        if (sqlite3_exec(c->index, sql, NULL, NULL, NULL) != SQLITE_OK) {
                log_error("failed to update cache index in %s: %s", c->dir, sqlite3_errmsg(c->index));
                return -EIO;
        }
        return 0;
}

static void index_close(Cache *c) {
        sqlite3_finalize(c->insert_stmt);
        sqlite3_finalize(c->delete_stmt);
        c->insert_stmt = c->delete_stmt = NULL;
        if (c->index)
                sqlite3_close(c->index);
        c->index = NULL;
}

/* Indexes written before the size limit existed have no used column: add it (ordered by when added). */
static int index_add_used_column(Cache *c) {
        sqlite3_stmt *stmt = NULL;
        bool has = false;

        if (sqlite3_prepare_v2(c->index, "SELECT 1 FROM pragma_table_info('objects') WHERE name = 'used'", -1, &stmt,
                               NULL) != SQLITE_OK)
                return -EIO;
        has = sqlite3_step(stmt) == SQLITE_ROW;
        sqlite3_finalize(stmt);
        if (has)
                return 0;
        if (sqlite3_exec(c->index,
                         "ALTER TABLE objects ADD COLUMN used INTEGER NOT NULL DEFAULT 0;"
                         "UPDATE objects SET used = added * 1000000;",
                         NULL, NULL, NULL) != SQLITE_OK)
                return -EIO;
        return 0;
}

/* Opens the index; returns 1 if it was created empty (so it needs a rebuild), -EBADMSG if damaged. */
static int index_connect(Cache *c) {
        char path[PATH_MAX];
        sqlite3_stmt *stmt = NULL;
        int64_t tables = 0;
        bool fresh, ok;

        snprintf(path, sizeof(path), "%s/index.sqlite", c->dir);
        fresh = access(path, F_OK) < 0;
        if (sqlite3_open_v2(path, &c->index, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                            NULL) != SQLITE_OK)
                goto damaged;
        sqlite3_busy_timeout(c->index, INDEX_BUSY_TIMEOUT_MS);
        if (sqlite3_prepare_v2(c->index, "PRAGMA quick_check", -1, &stmt, NULL) != SQLITE_OK ||
            sqlite3_step(stmt) != SQLITE_ROW)
                goto damaged;
        ok = strcmp((const char *) sqlite3_column_text(stmt, 0), "ok") == 0;
        sqlite3_finalize(stmt);
        stmt = NULL;
        if (!ok)
                goto damaged;
        /* The index is a summary of the files: losing its last writes in a crash costs nothing. */
        /* A small write-ahead log, checkpointed and cut back often: the index shares the cache's file system,
         * whose room the cache fills. */
        if (sqlite3_exec(c->index, "PRAGMA journal_mode = WAL; PRAGMA synchronous = OFF; "
                                   "PRAGMA wal_autocheckpoint = 64; PRAGMA journal_size_limit = 262144;",
                         NULL, NULL, NULL) != SQLITE_OK)
                goto damaged;
        if (sqlite3_prepare_v2(c->index, "SELECT count(*) FROM sqlite_master WHERE name = 'objects'", -1, &stmt,
                               NULL) != SQLITE_OK || sqlite3_step(stmt) != SQLITE_ROW)
                goto damaged;
        tables = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
        stmt = NULL;
        /* used: last read or write (microseconds), the LRU order; pins: objects that must not be evicted, by owner
         * (a state directory); meta: the eviction count of every process, for honest hoard reports. */
        if (sqlite3_exec(c->index,
                         "CREATE TABLE IF NOT EXISTS objects (tag BLOB PRIMARY KEY, size INTEGER NOT NULL, "
                         "added INTEGER NOT NULL) WITHOUT ROWID", NULL, NULL, NULL) != SQLITE_OK ||
            index_add_used_column(c) < 0 ||
            sqlite3_exec(c->index,
                         "CREATE INDEX IF NOT EXISTS objects_used ON objects (used);"
                         "CREATE TABLE IF NOT EXISTS pins (tag BLOB NOT NULL, owner TEXT NOT NULL, "
                         "PRIMARY KEY (tag, owner)) WITHOUT ROWID;"
                         "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);",
                         NULL, NULL, NULL) != SQLITE_OK ||
            sqlite3_prepare_v3(c->index,
                               "INSERT OR REPLACE INTO objects (tag, size, added, used) VALUES (?1, ?2, ?3, ?4)",
                               -1, SQLITE_PREPARE_PERSISTENT, &c->insert_stmt, NULL) != SQLITE_OK ||
            sqlite3_prepare_v3(c->index, "DELETE FROM objects WHERE tag = ?1", -1, SQLITE_PREPARE_PERSISTENT,
                               &c->delete_stmt, NULL) != SQLITE_OK)
                goto damaged;
        return fresh || tables == 0 ? 1 : 0;

damaged:
        log_warning("cache index %s is damaged (%s): rebuilding it from the cache files", path,
                    c->index ? sqlite3_errmsg(c->index) : "cannot open");
        sqlite3_finalize(stmt);
        index_close(c);
        return -EBADMSG;
}

static int index_open(Cache *c) {
        char path[PATH_MAX], aside[PATH_MAX + 16];
        int r;

        r = index_connect(c);
        if (r == -EBADMSG) {
                snprintf(path, sizeof(path), "%s/index.sqlite", c->dir);
                snprintf(aside, sizeof(aside), "%s.damaged", path);
                if (rename(path, aside) < 0 && errno != ENOENT)
                        return -errno;
                for (const char *suffix = "-wal"; suffix; suffix = strcmp(suffix, "-wal") == 0 ? "-shm" : NULL) {
                        char aux[PATH_MAX + 8];

                        snprintf(aux, sizeof(aux), "%s%s", path, suffix);
                        unlink(aux);
                }
                r = index_connect(c);
                if (r < 0)
                        return -EIO;
                r = 1;
        }
        if (r == 1)
                return cache_rebuild_index(c);
        return r;
}

static int64_t now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_REALTIME, &ts);
        return (int64_t) ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void evictor_kick_locked(Cache *c) {
        c->evict_wanted = true;
        pthread_cond_signal(&c->evict_cond);
}

static int room_make_locked(Cache *c, uint64_t len, int64_t keep_since, bool physical);

static void index_insert(Cache *c, const uint8_t tag[CACHE_TAG_LEN], size_t len, int64_t keep_since) {
        int rc;

        pthread_mutex_lock(&c->lock);
        c->put_bytes += len;
        c->bytes_est += len;
        c->pending -= len < c->pending ? len : c->pending;
        if (c->limit > 0 && c->put_bytes > c->limit / 16)
                evictor_kick_locked(c);
        sqlite3_bind_blob(c->insert_stmt, 1, tag, CACHE_TAG_LEN, SQLITE_STATIC);
        sqlite3_bind_int64(c->insert_stmt, 2, (int64_t) len);
        sqlite3_bind_int64(c->insert_stmt, 3, (int64_t) time(NULL));
        sqlite3_bind_int64(c->insert_stmt, 4, now_us());
        rc = sqlite3_step(c->insert_stmt);
        sqlite3_reset(c->insert_stmt);
        /* The index lives on the same file system: a full one gets room as an object would, once. */
        if (rc == SQLITE_FULL && room_make_locked(c, 64 << 10, keep_since, true) >= 0)
                rc = sqlite3_step(c->insert_stmt);
        if (rc != SQLITE_DONE)
                log_warning("failed to update cache index in %s: %s", c->dir, sqlite3_errmsg(c->index));
        sqlite3_reset(c->insert_stmt);
        pthread_mutex_unlock(&c->lock);
}

static void index_delete(Cache *c, const uint8_t tag[CACHE_TAG_LEN]) {
        pthread_mutex_lock(&c->lock);
        sqlite3_bind_blob(c->delete_stmt, 1, tag, CACHE_TAG_LEN, SQLITE_STATIC);
        if (sqlite3_step(c->delete_stmt) != SQLITE_DONE)
                log_warning("failed to update cache index in %s: %s", c->dir, sqlite3_errmsg(c->index));
        sqlite3_reset(c->delete_stmt);
        pthread_mutex_unlock(&c->lock);
}

int cache_rebuild_index(Cache *c) {
        char path[PATH_MAX];
        uint64_t n = 0;
        int r;

        pthread_mutex_lock(&c->lock);
        r = index_exec(c, "BEGIN; DELETE FROM objects;");
        if (r < 0)
                goto out_unlock;
        /* chunks/ab/cd/<hex>: three levels, names checked so that stray files are ignored. */
        for (unsigned a = 0; a < 256; a++) {
                for (unsigned b = 0; b < 256; b++) {
                        DIR *d;
                        struct dirent *de;

                        snprintf(path, sizeof(path), "%s/chunks/%02x/%02x", c->dir, a, b);
                        d = opendir(path);
                        if (!d)
                                continue;
                        while ((de = readdir(d))) {
                                uint8_t tag[CACHE_TAG_LEN];
                                struct stat st;
                                char prefix[5];

                                snprintf(prefix, sizeof(prefix), "%02x%02x", a, b);
                                if (strlen(de->d_name) != TAG_HEX_LEN || strncmp(de->d_name, prefix, 4) != 0 ||
                                    hex_decode_exact(de->d_name, tag, CACHE_TAG_LEN) < 0)
                                        continue;
                                if (fstatat(dirfd(d), de->d_name, &st, 0) < 0 || !S_ISREG(st.st_mode))
                                        continue;
                                sqlite3_bind_blob(c->insert_stmt, 1, tag, CACHE_TAG_LEN, SQLITE_TRANSIENT);
                                sqlite3_bind_int64(c->insert_stmt, 2, (int64_t) st.st_size);
                                sqlite3_bind_int64(c->insert_stmt, 3, (int64_t) st.st_mtime);
                                sqlite3_bind_int64(c->insert_stmt, 4, (int64_t) st.st_mtime * 1000000);
                                sqlite3_step(c->insert_stmt);
                                sqlite3_reset(c->insert_stmt);
                                n++;
                        }
                        closedir(d);
                }
        }
        r = index_exec(c, "COMMIT");
        if (r >= 0)
                log_info("rebuilt cache index of %s: %llu objects", c->dir, (unsigned long long) n);
out_unlock:
        pthread_mutex_unlock(&c->lock);
        return r;
}

/* --- last use, pins, eviction ----------------------------------------------------------------------- */

/* Writes the noted last uses in one transaction; with the lock held.  Losing them costs only LRU order. */
static void uses_flush_locked(Cache *c) {
        sqlite3_stmt *stmt = NULL;
        int64_t now = now_us();

        if (c->n_uses == 0)
                return;
        if (sqlite3_exec(c->index, "BEGIN", NULL, NULL, NULL) != SQLITE_OK)
                goto out;
        if (sqlite3_prepare_v2(c->index, "UPDATE objects SET used = ?2 WHERE tag = ?1", -1, &stmt, NULL) == SQLITE_OK) {
                for (size_t i = 0; i < c->n_uses; i++) {
                        sqlite3_bind_blob(stmt, 1, c->uses[i], CACHE_TAG_LEN, SQLITE_STATIC);
                        sqlite3_bind_int64(stmt, 2, now);
                        sqlite3_step(stmt);
                        sqlite3_reset(stmt);
                }
        }
        sqlite3_finalize(stmt);
        if (sqlite3_exec(c->index, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
                log_warning("failed to update cache index in %s: %s", c->dir, sqlite3_errmsg(c->index));
                sqlite3_exec(c->index, "ROLLBACK", NULL, NULL, NULL);
        }
out:
        c->n_uses = 0;
}

static void use_note(Cache *c, const uint8_t tag[CACHE_TAG_LEN]) {
        pthread_mutex_lock(&c->lock);
        if (c->uses) {
                memcpy(c->uses[c->n_uses++], tag, CACHE_TAG_LEN);
                if (c->n_uses == USES_MAX)
                        uses_flush_locked(c);
        }
        pthread_mutex_unlock(&c->lock);
}

int cache_set_owner(Cache *c, const char *owner) {
        char *copy = strdup(owner);

        if (!copy)
                return -ENOMEM;
        pthread_mutex_lock(&c->lock);
        free(c->owner);
        c->owner = copy;
        pthread_mutex_unlock(&c->lock);
        return 0;
}

/*
 * Runs one statement per tag (bound as ?1, the owner as ?2) in one write transaction, after dropping
 * every pin of this owner if reset; lock held.
 */
static int pins_update_locked(Cache *c, bool reset, const char *sql, const uint8_t (*tags)[CACHE_TAG_LEN],
                              size_t n) {
        sqlite3_stmt *stmt = NULL;
        int r = 0;

        if (sqlite3_exec(c->index, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
                goto fail;
        if (reset) {
                if (sqlite3_prepare_v2(c->index, "DELETE FROM pins WHERE owner = ?1", -1, &stmt, NULL) != SQLITE_OK)
                        goto fail_rollback;
                sqlite3_bind_text(stmt, 1, c->owner ? c->owner : "", -1, SQLITE_STATIC);
                if (sqlite3_step(stmt) != SQLITE_DONE)
                        goto fail_rollback;
                sqlite3_finalize(stmt);
                stmt = NULL;
        }
        if (sqlite3_prepare_v2(c->index, sql, -1, &stmt, NULL) != SQLITE_OK)
                goto fail_rollback;
        for (size_t i = 0; i < n; i++) {
                sqlite3_bind_blob(stmt, 1, tags[i], CACHE_TAG_LEN, SQLITE_STATIC);
                sqlite3_bind_text(stmt, 2, c->owner ? c->owner : "", -1, SQLITE_STATIC);
                if (sqlite3_step(stmt) != SQLITE_DONE)
                        goto fail_rollback;
                sqlite3_reset(stmt);
        }
        sqlite3_finalize(stmt);
        if (sqlite3_exec(c->index, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
                goto fail_rollback;
        return 0;

fail_rollback:
        r = -EIO;
        log_error("failed to update the pins in cache index %s: %s", c->dir, sqlite3_errmsg(c->index));
        sqlite3_finalize(stmt);
        sqlite3_exec(c->index, "ROLLBACK", NULL, NULL, NULL);
        return r;
fail:
        log_error("failed to update the pins in cache index %s: %s", c->dir, sqlite3_errmsg(c->index));
        return -EIO;
}

int cache_pin(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n) {
        int r;

        if (n == 0)
                return 0;
        pthread_mutex_lock(&c->lock);
        r = pins_update_locked(c, false, "INSERT OR IGNORE INTO pins (tag, owner) VALUES (?1, ?2)", tags, n);
        pthread_mutex_unlock(&c->lock);
        return r;
}

int cache_unpin(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n) {
        int r;

        if (n == 0)
                return 0;
        pthread_mutex_lock(&c->lock);
        r = pins_update_locked(c, false, "DELETE FROM pins WHERE tag = ?1 AND owner = ?2", tags, n);
        pthread_mutex_unlock(&c->lock);
        return r;
}

int cache_pins_replace(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n) {
        int r;

        pthread_mutex_lock(&c->lock);
        r = pins_update_locked(c, true, "INSERT OR IGNORE INTO pins (tag, owner) VALUES (?1, ?2)", tags, n);
        pthread_mutex_unlock(&c->lock);
        return r;
}

int cache_pins_replace_owner(Cache *c, const char *owner, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n) {
        char *copy = strdup(owner), *saved;
        int r;

        if (!copy)
                return -ENOMEM;
        pthread_mutex_lock(&c->lock);
        saved = c->owner;
        c->owner = copy;
        r = pins_update_locked(c, true, "INSERT OR IGNORE INTO pins (tag, owner) VALUES (?1, ?2)", tags, n);
        c->owner = saved;
        pthread_mutex_unlock(&c->lock);
        free(copy);
        return r;
}

static int64_t index_query_int64(Cache *c, const char *sql) {
        sqlite3_stmt *stmt = NULL;
        int64_t v = -1;

        if (sqlite3_prepare_v2(c->index, sql, -1, &stmt, NULL) == SQLITE_OK && sqlite3_step(stmt) == SQLITE_ROW)
                v = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
        return v;
}

/*
 * Removes up to EVICT_STEP least recently used unpinned objects (last used before keep_since, unless it
 * is 0) until want bytes are freed; lock held.  Selecting, unlinking and deleting the rows happen in one
 * write transaction: a pin (also a write transaction) lands either before it, and the object is not
 * selected, or after, and its file is put back by the rename that follows every pin.  Adds the bytes
 * freed to *freed; returns the objects evicted or a negative errno.
 */
/* Removes an object's file (`rel`, its path in the cache) and then its index row through `del`, the caller's
 * prepared "DELETE FROM objects WHERE tag = ?1", in the caller's transaction; a file already gone is no
 * error. `what` names the act in the error message ("evict", "drop"). */
static int object_remove_locked(Cache *c, sqlite3_stmt *del, const uint8_t tag[CACHE_TAG_LEN], const char *rel,
                                const char *what) {
        int r;

        if (unlinkat(c->dir_fd, rel, 0) < 0 && errno != ENOENT) {
                r = -errno;
                log_error("failed to %s cache object %s/%s: %s", what, c->dir, rel, strerror(-r));
                return r;
        }
        sqlite3_bind_blob(del, 1, tag, CACHE_TAG_LEN, SQLITE_STATIC);
        sqlite3_step(del);
        sqlite3_reset(del);
        return 0;
}

static int evict_step_locked(Cache *c, uint64_t want, int64_t keep_since, uint64_t *freed) {
        sqlite3_stmt *select = NULL, *del = NULL;
        uint8_t tags[EVICT_STEP][CACHE_TAG_LEN];
        int64_t sizes[EVICT_STEP];
        uint64_t done = 0;
        int n = 0, n_candidates = 0, r;

        if (sqlite3_exec(c->index, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
                return -EIO;
        if (sqlite3_prepare_v2(c->index,
                               "SELECT tag, size FROM objects WHERE tag NOT IN (SELECT tag FROM pins) "
                               "AND (?2 = 0 OR used < ?2) ORDER BY used, added LIMIT ?1", -1, &select,
                               NULL) != SQLITE_OK ||
            sqlite3_prepare_v2(c->index, "DELETE FROM objects WHERE tag = ?1", -1, &del, NULL) != SQLITE_OK) {
                r = -EIO;
                goto out_rollback;
        }
        /* Candidates first: the table must not change under a running SELECT. */
        sqlite3_bind_int(select, 1, EVICT_STEP);
        sqlite3_bind_int64(select, 2, keep_since);
        while (n_candidates < EVICT_STEP && sqlite3_step(select) == SQLITE_ROW) {
                if (sqlite3_column_bytes(select, 0) != CACHE_TAG_LEN)
                        continue;
                memcpy(tags[n_candidates], sqlite3_column_blob(select, 0), CACHE_TAG_LEN);
                sizes[n_candidates++] = sqlite3_column_int64(select, 1);
        }
        sqlite3_finalize(select);
        select = NULL;
        for (; n < n_candidates && done < want; n++) {
                char rel[sizeof("chunks/ab/cd/") + TAG_HEX_LEN];

                object_relpath(tags[n], rel);
                r = object_remove_locked(c, del, tags[n], rel, "evict");
                if (r < 0)
                        goto out_rollback;
                done += sizes[n] > 0 ? (uint64_t) sizes[n] : 0;
        }
        sqlite3_finalize(del);
        del = NULL;
        if (n > 0) {
                char sql[160];

                snprintf(sql, sizeof(sql),
                         "INSERT INTO meta (name, value) VALUES ('evictions', %d) "
                         "ON CONFLICT (name) DO UPDATE SET value = value + %d", n, n);
                if (sqlite3_exec(c->index, sql, NULL, NULL, NULL) != SQLITE_OK) {
                        r = -EIO;
                        goto out_rollback;
                }
        }
        if (sqlite3_exec(c->index, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
                r = -EIO;
                goto out_rollback;
        }
        c->evictions += (uint64_t) n;
        c->bytes_est -= done < c->bytes_est ? done : c->bytes_est;
        *freed += done;
        return n;

out_rollback:
        sqlite3_finalize(select);
        sqlite3_finalize(del);
        sqlite3_exec(c->index, "ROLLBACK", NULL, NULL, NULL);
        return r;
}

/* Re-reads the index's total (with the noted last uses written first, for the LRU order); lock held. */
static int bytes_refresh_locked(Cache *c) {
        int64_t bytes;

        uses_flush_locked(c);
        bytes = index_query_int64(c, "SELECT coalesce(sum(size), 0) FROM objects");
        if (bytes < 0)
                return -EIO;
        c->bytes_est = (uint64_t) bytes;
        return 0;
}

/* Brings the cache below 90 % of its limit, least recently used first; lock held. */
static int evict_locked(Cache *c) {
        uint64_t low = c->limit / 10 * 9, freed = 0;
        int r = 0;

        if (c->limit == 0)
                return 0;       /* the limit was lifted while the evictor runs */
        r = bytes_refresh_locked(c);
        if (r < 0)
                return r;
        if (c->bytes_est + c->pending + c->reserved <= c->limit)
                return 0;
        while (c->bytes_est + c->pending + c->reserved > low) {
                r = evict_step_locked(c, c->bytes_est + c->pending + c->reserved - low, 0, &freed);
                if (r < 0) {
                        log_warning("failed to evict from cache %s: %s", c->dir, sqlite3_errmsg(c->index));
                        return r;
                }
                if (r == 0)
                        break;          /* everything left is pinned */
                /* Let readers note their uses and writers index their objects between steps. */
                pthread_mutex_unlock(&c->lock);
                pthread_mutex_lock(&c->lock);
        }
        return 0;
}

/* --- room ------------------------------------------------------------------------------------------- */

/* What an object of len bytes takes on the file system: whole blocks. */
static uint64_t fs_cost(uint64_t len) {
        return (len + 4095) / 4096 * 4096;
}

/* Space on the file system under the cache that we may use, its size, and the floor kept free. */
static int fs_space(Cache *c, uint64_t *ret_avail, uint64_t *ret_size, uint64_t *ret_floor) {
        struct statvfs st;

        if (fstatvfs(c->dir_fd, &st) < 0)
                return -errno;
        *ret_avail = (uint64_t) st.f_bavail * st.f_frsize;
        *ret_size = (uint64_t) st.f_blocks * st.f_frsize;
        /* At least a quarter megabyte (the index's write-ahead log grows in pages), at most a megabyte. */
        *ret_floor = *ret_size / 64 < ROOM_FLOOR_MIN ? ROOM_FLOOR_MIN :
                     *ret_size / 64 < ROOM_FLOOR_MAX ? *ret_size / 64 : ROOM_FLOOR_MAX;
        return 0;
}

/*
 * Makes room for an object of len bytes, evicting least recently used unpinned objects (those last used
 * before keep_since, if it is not 0) until it fits; lock held.  With physical, only the file system counts
 * (a write it refused: the reservations and the limit were checked before); otherwise the object must fit
 * under the limit with every reservation, and on the file system (in whole blocks) with every reservation
 * and the floor free.  Returns the objects evicted (0: it fitted), or -ENOSPC when nothing more may be
 * evicted.
 */
static int room_make_locked(Cache *c, uint64_t len, int64_t keep_since, bool physical) {
        uint64_t need = fs_cost(len);
        uint64_t avail = 0, size = 0, floor = 0, start_avail = 0, freed = 0, reserved = physical ? 0 : c->reserved;
        bool refreshed = false;
        int evicted = 0, r;

        for (;;) {
                uint64_t fs_short = 0, limit_short = 0, have;

                r = fs_space(c, &avail, &size, &floor);
                if (r < 0)
                        return r;
                if (!refreshed)
                        start_avail = avail;
                /* Some file systems give freed blocks back only at their next commit: count what was freed. */
                have = avail > start_avail + freed ? avail : start_avail + freed;
                if (have < reserved + need + floor)
                        fs_short = reserved + need + floor - have;
                if (!physical && c->limit > 0 && c->bytes_est + c->pending + reserved + len > c->limit)
                        limit_short = c->bytes_est + c->pending + reserved + len - c->limit;
                if (fs_short == 0 && limit_short == 0)
                        return evicted;
                if (!refreshed) {
                        /* Exact figures before evicting: other processes add and evict too. */
                        refreshed = true;
                        r = bytes_refresh_locked(c);
                        if (r < 0)
                                return r;
                        continue;
                }
                /* Under the limit, go down to 90 % of it, as the evictor does, rather than one object at a time. */
                if (limit_short > 0 && c->bytes_est > c->limit / 10 * 9 && c->bytes_est - c->limit / 10 * 9 > limit_short)
                        limit_short = c->bytes_est - c->limit / 10 * 9;
                r = evict_step_locked(c, fs_short > limit_short ? fs_short : limit_short, keep_since, &freed);
                if (r < 0)
                        return r;
                if (r == 0)
                        return -ENOSPC;
                evicted += r;
        }
}

static bool is_full(int r) {
        return r == -ENOSPC || r == -EDQUOT;
}

/* Room for a new object of len bytes (see room_make_locked()), counted as pending until it is indexed (or
 * pending_drop()); -ENOSPC if there is none. */
static int room_for(Cache *c, size_t len, int64_t keep_since) {
        int r;

        pthread_mutex_lock(&c->lock);
        r = room_make_locked(c, len, keep_since, false);
        if (is_full(r))
                c->refused++;
        else if (r >= 0)
                c->pending += len;
        pthread_mutex_unlock(&c->lock);
        return r < 0 ? r : 0;
}

static void pending_drop(Cache *c, size_t len) {
        pthread_mutex_lock(&c->lock);
        c->pending -= len < c->pending ? len : c->pending;
        pthread_mutex_unlock(&c->lock);
}

int cache_reserve(Cache *c, uint64_t bytes) {
        int r;

        pthread_mutex_lock(&c->lock);
        r = room_make_locked(c, fs_cost(bytes), 0, false);
        if (r >= 0)
                c->reserved += fs_cost(bytes);
        else if (is_full(r))
                c->refused++;
        pthread_mutex_unlock(&c->lock);
        return r < 0 ? r : 0;
}

void cache_unreserve(Cache *c, uint64_t bytes) {
        pthread_mutex_lock(&c->lock);
        c->reserved -= fs_cost(bytes) < c->reserved ? fs_cost(bytes) : c->reserved;
        pthread_mutex_unlock(&c->lock);
}

/*
 * After the file system refused a write with ENOSPC (err): evicts to make physical room for len bytes.
 * Returns true if the write may be tried again (something was evicted, and the rounds are not used up).
 */
static bool room_retry(Cache *c, int err, size_t len, int64_t keep_since, int *round) {
        int r;

        if (!is_full(err) || ++*round > ROOM_RETRIES)
                return false;
        pthread_mutex_lock(&c->lock);
        r = room_make_locked(c, len, keep_since, true);
        if (r < 0)
                c->refused++;
        pthread_mutex_unlock(&c->lock);
        return r >= 0;
}

int cache_evict(Cache *c) {
        int r = 0;

        pthread_mutex_lock(&c->lock);
        if (c->limit > 0)
                r = evict_locked(c);
        pthread_mutex_unlock(&c->lock);
        return r;
}

static void *evictor_thread(void *userdata) {
        Cache *c = userdata;

        pthread_mutex_lock(&c->lock);
        while (!c->stopping) {
                if (!c->evict_wanted) {
                        struct timespec deadline;

                        clock_gettime(CLOCK_REALTIME, &deadline);
                        deadline.tv_sec += EVICT_INTERVAL_MS / 1000;
                        pthread_cond_timedwait(&c->evict_cond, &c->lock, &deadline);
                }
                if (c->stopping)
                        break;
                c->evict_wanted = false;
                c->put_bytes = 0;
                evict_locked(c);
        }
        pthread_mutex_unlock(&c->lock);
        return NULL;
}

int cache_set_limit(Cache *c, uint64_t limit) {
        int r = 0;

        pthread_mutex_lock(&c->lock);
        c->limit = limit;
        if (limit > 0 && !c->evictor_started) {
                r = -pthread_create(&c->evictor, NULL, evictor_thread, c);
                c->evictor_started = r == 0;
        }
        if (limit > 0)
                evictor_kick_locked(c);
        pthread_mutex_unlock(&c->lock);
        return r;
}

int64_t cache_size_parse(const char *text) {
        unsigned long long v;
        char *end;
        int shift = 20;

        errno = 0;
        v = strtoull(text, &end, 10);
        if (errno || end == text)
                return -EINVAL;
        switch (*end) {
        case 0:
                break;
        case 'k': case 'K':
                shift = 10;
                break;
        case 'm': case 'M':
                shift = 20;
                break;
        case 'g': case 'G':
                shift = 30;
                break;
        case 't': case 'T':
                shift = 40;
                break;
        default:
                return -EINVAL;
        }
        if (*end && end[1] && strcmp(end + 1, "iB") != 0 && strcmp(end + 1, "B") != 0)
                return -EINVAL;
        if (v > (unsigned long long) (INT64_MAX >> shift))
                return -EINVAL;
        return (int64_t) (v << shift);
}

/* The bytes of the pinned objects (of one owner, or of any with owner NULL); lock held. */
static int64_t pinned_bytes_locked(Cache *c, const char *owner) {
        sqlite3_stmt *stmt = NULL;
        int64_t v = -1;

        if (sqlite3_prepare_v2(c->index,
                               owner ? "SELECT coalesce(sum(size), 0) FROM objects WHERE tag IN "
                                       "(SELECT tag FROM pins WHERE owner = ?1)"
                                     : "SELECT coalesce(sum(size), 0) FROM objects WHERE tag IN (SELECT tag FROM pins)",
                               -1, &stmt, NULL) != SQLITE_OK)
                return -1;
        if (owner)
                sqlite3_bind_text(stmt, 1, owner, -1, SQLITE_STATIC);
        if (sqlite3_step(stmt) == SQLITE_ROW)
                v = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
        return v;
}

int cache_status(Cache *c, CacheStatus *ret) {
        int64_t objects, bytes, total, pinned, pinned_bytes, own = 0;
        uint64_t avail = 0, size = 0, floor = 0, pending, clean, by_fs, by_limit;

        memset(ret, 0, sizeof(*ret));
        pthread_mutex_lock(&c->lock);
        objects = index_query_int64(c, "SELECT count(*) FROM objects");
        bytes = index_query_int64(c, "SELECT coalesce(sum(size), 0) FROM objects");
        total = index_query_int64(c, "SELECT coalesce((SELECT value FROM meta WHERE name = 'evictions'), 0)");
        pinned = index_query_int64(c, "SELECT count(DISTINCT tag) FROM pins");
        pinned_bytes = pinned_bytes_locked(c, NULL);
        if (c->owner)
                own = pinned_bytes_locked(c, c->owner);
        if (bytes >= 0)
                c->bytes_est = (uint64_t) bytes;
        ret->limit = c->limit;
        ret->evictions = c->evictions;
        ret->reserved = c->reserved;
        ret->refused = c->refused;
        pending = c->pending;
        fs_space(c, &avail, &size, &floor);
        pthread_mutex_unlock(&c->lock);
        if (objects < 0 || bytes < 0 || total < 0 || pinned < 0 || pinned_bytes < 0 || own < 0)
                return -EIO;
        ret->objects = (uint64_t) objects;
        ret->bytes = (uint64_t) bytes;
        ret->evictions_total = (uint64_t) total;
        ret->pinned = (uint64_t) pinned;
        ret->pinned_bytes = (uint64_t) pinned_bytes;
        ret->own_pinned_bytes = (uint64_t) own;
        ret->fs_free = avail;
        ret->fs_size = size;
        /* Room after evicting every clean object: on the file system, and under the limit. */
        clean = ret->bytes > ret->pinned_bytes ? ret->bytes - ret->pinned_bytes : 0;
        by_fs = avail + clean > ret->reserved + floor ? avail + clean - ret->reserved - floor : 0;
        by_limit = c->limit == 0 ? UINT64_MAX :
                   c->limit > ret->pinned_bytes + ret->reserved + pending ?
                           c->limit - ret->pinned_bytes - ret->reserved - pending : 0;
        ret->room = by_fs < by_limit ? by_fs : by_limit;
        return 0;
}

uint64_t cache_evictions_total(Cache *c) {
        int64_t total;

        pthread_mutex_lock(&c->lock);
        total = index_query_int64(c, "SELECT coalesce((SELECT value FROM meta WHERE name = 'evictions'), 0)");
        pthread_mutex_unlock(&c->lock);
        return total < 0 ? 0 : (uint64_t) total;
}

int cache_usage(Cache *c, uint64_t *ret_objects, uint64_t *ret_bytes) {
        sqlite3_stmt *stmt = NULL;
        int r = 0;

        pthread_mutex_lock(&c->lock);
        if (sqlite3_prepare_v2(c->index, "SELECT count(*), coalesce(sum(size), 0) FROM objects", -1, &stmt, NULL) !=
                    SQLITE_OK ||
            sqlite3_step(stmt) != SQLITE_ROW) {
                r = -EIO;
        } else {
                *ret_objects = (uint64_t) sqlite3_column_int64(stmt, 0);
                *ret_bytes = (uint64_t) sqlite3_column_int64(stmt, 1);
        }
        sqlite3_finalize(stmt);
        pthread_mutex_unlock(&c->lock);
        return r;
}

/* --- files ------------------------------------------------------------------------------------------ */

static void tmp_sweep(Cache *c) {
        char path[PATH_MAX];
        struct dirent *de;
        time_t now = time(NULL);
        DIR *d;

        snprintf(path, sizeof(path), "%s/tmp", c->dir);
        d = opendir(path);
        if (!d)
                return;
        while ((de = readdir(d))) {
                struct stat st;

                if (de->d_name[0] == '.')
                        continue;
                if (fstatat(dirfd(d), de->d_name, &st, 0) == 0 && now - st.st_mtime > TMP_MAX_AGE_SECONDS)
                        unlinkat(dirfd(d), de->d_name, 0);
        }
        closedir(d);
}

int cache_open(const char *dir, Cache **ret) {
        Cache *c;
        int r;

        c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        pthread_mutex_init(&c->lock, NULL);
        pthread_cond_init(&c->evict_cond, NULL);
        c->dir_fd = -1;
        c->dir = strdup(dir);
        c->uses = malloc(USES_MAX * sizeof(*c->uses));
        if (!c->dir || !c->uses) {
                r = -ENOMEM;
                goto out_free;
        }
        if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
                r = -errno;
                log_error("failed to create cache directory %s: %s", dir, strerror(-r));
                goto out_free;
        }
        c->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (c->dir_fd < 0) {
                r = -errno;
                log_error("failed to open cache directory %s: %s", dir, strerror(-r));
                goto out_free;
        }
        if ((r = mkdir_p_at(c->dir_fd, "chunks")) < 0 || (r = mkdir_p_at(c->dir_fd, "tmp")) < 0 ||
            (r = mkdir_p_at(c->dir_fd, "quarantine")) < 0) {
                log_error("failed to create the layout of cache %s: %s", dir, strerror(-r));
                goto out_free;
        }
        tmp_sweep(c);
        r = index_open(c);
        if (r >= 0) {
                pthread_mutex_lock(&c->lock);
                r = bytes_refresh_locked(c);
                pthread_mutex_unlock(&c->lock);
        }
        if (r < 0)
                goto out_free;
        *ret = c;
        return 0;

out_free:
        cache_free(c);
        return r;
}

Cache *cache_free(Cache *c) {
        if (!c)
                return NULL;
        pthread_mutex_lock(&c->lock);
        c->stopping = true;
        pthread_cond_signal(&c->evict_cond);
        pthread_mutex_unlock(&c->lock);
        if (c->evictor_started)
                pthread_join(c->evictor, NULL);
        if (c->index)
                uses_flush_locked(c);
        index_close(c);
        if (c->dir_fd >= 0)
                close(c->dir_fd);
        pthread_cond_destroy(&c->evict_cond);
        pthread_mutex_destroy(&c->lock);
        free(c->uses);
        free(c->owner);
        free(c->dir);
        free(c);
        return NULL;
}

bool cache_has(Cache *c, const uint8_t tag[CACHE_TAG_LEN]) {
        char rel[sizeof("chunks/ab/cd/") + TAG_HEX_LEN];

        object_relpath(tag, rel);
        return faccessat(c->dir_fd, rel, F_OK, 0) == 0;
}

int cache_quarantine(Cache *c, const uint8_t tag[CACHE_TAG_LEN]) {
        char rel[sizeof("chunks/ab/cd/") + TAG_HEX_LEN], hex[TAG_HEX_LEN + 1], dest[TAG_HEX_LEN + 64];
        struct timespec ts;
        int r = 0;

        object_relpath(tag, rel);
        hex_encode(tag, CACHE_TAG_LEN, hex);
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(dest, sizeof(dest), "quarantine/%s.%lld.%09ld", hex, (long long) ts.tv_sec, ts.tv_nsec);
        if (renameat(c->dir_fd, rel, c->dir_fd, dest) < 0 && errno != ENOENT) {
                r = -errno;
                log_error("failed to quarantine cache object %s: %s", hex, strerror(-r));
                /* Never leave a bad object where it would be read again. */
                unlinkat(c->dir_fd, rel, 0);
        }
        index_delete(c, tag);
        return r;
}

int cache_drop(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n, uint64_t *ret_bytes, size_t *ret_pinned) {
        sqlite3_stmt *pinned = NULL, *del = NULL;
        uint64_t bytes = 0;
        size_t kept = 0;
        int dropped = 0, r;

        pthread_mutex_lock(&c->lock);
        uses_flush_locked(c);
        if (sqlite3_exec(c->index, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) {
                r = -EIO;
                goto out_unlock;
        }
        if (sqlite3_prepare_v2(c->index, "SELECT 1 FROM pins WHERE tag = ?1 LIMIT 1", -1, &pinned, NULL) != SQLITE_OK ||
            sqlite3_prepare_v2(c->index, "DELETE FROM objects WHERE tag = ?1", -1, &del, NULL) != SQLITE_OK) {
                r = -EIO;
                goto out_rollback;
        }
        for (size_t i = 0; i < n; i++) {
                char rel[sizeof("chunks/ab/cd/") + TAG_HEX_LEN];
                struct stat st;
                bool is_pinned;

                sqlite3_bind_blob(pinned, 1, tags[i], CACHE_TAG_LEN, SQLITE_STATIC);
                is_pinned = sqlite3_step(pinned) == SQLITE_ROW;
                sqlite3_reset(pinned);
                object_relpath(tags[i], rel);
                /* The file is the truth (the index may miss it after a crash): its size is what is freed. */
                if (fstatat(c->dir_fd, rel, &st, AT_SYMLINK_NOFOLLOW) < 0)
                        continue;
                if (is_pinned) {
                        kept++;
                        continue;
                }
                r = object_remove_locked(c, del, tags[i], rel, "drop");
                if (r < 0)
                        goto out_rollback;
                bytes += (uint64_t) st.st_size;
                dropped++;
        }
        sqlite3_finalize(pinned);
        sqlite3_finalize(del);
        if (sqlite3_exec(c->index, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
                sqlite3_exec(c->index, "ROLLBACK", NULL, NULL, NULL);
                r = -EIO;
                goto out_unlock;
        }
        c->bytes_est -= bytes < c->bytes_est ? bytes : c->bytes_est;
        pthread_mutex_unlock(&c->lock);
        *ret_bytes = bytes;
        *ret_pinned = kept;
        return dropped;

out_rollback:
        sqlite3_finalize(pinned);
        sqlite3_finalize(del);
        sqlite3_exec(c->index, "ROLLBACK", NULL, NULL, NULL);
out_unlock:
        pthread_mutex_unlock(&c->lock);
        return r;
}

/*
 * Opens an object for reading: without atime updates where allowed (the index records use itself, and a
 * first read would dirty every inode), and with *direct, with O_DIRECT if the file system takes it
 * (*direct is cleared if not).
 */
static int object_open(Cache *c, const char *rel, bool *direct) {
        int flags = O_RDONLY | O_CLOEXEC | O_NOATIME, fd;

        for (;;) {
                fd = openat(c->dir_fd, rel, flags | (*direct ? O_DIRECT : 0));
                if (fd >= 0)
                        return fd;
                if (errno == EINVAL && *direct)
                        *direct = false;
                else if (errno == EPERM && (flags & O_NOATIME))
                        flags &= ~O_NOATIME;
                else
                        return errno == ENOENT ? -ENOENT : -errno;
        }
}

/*
 * Reads and verifies the object named tag into *buf (size bytes), or into a malloc()ed buffer of the
 * file's size returned in *buf when *buf is NULL.  -ENOBUFS: the file is larger than size.  A caller's
 * buffer aligned for direct I/O is read with O_DIRECT: the caller keeps the plaintext it decodes, and the
 * kernel caches what vulpes serves, so caching the ciphertext as well would only cost page allocations
 * and take memory from the guest.
 */
static int object_read(Cache *c, const uint8_t tag[CACHE_TAG_LEN], uint8_t **buf, size_t size, size_t *ret_len) {
        char rel[sizeof("chunks/ab/cd/") + TAG_HEX_LEN];
        uint8_t *data = *buf;
        bool direct = data && (uintptr_t) data % DIRECT_ALIGN == 0 && size % DIRECT_ALIGN == 0;
        struct stat st;
        size_t len = 0;
        int fd, r;

        object_relpath(tag, rel);
        fd = object_open(c, rel, &direct);
        if (fd < 0)
                return fd;
        if (fstat(fd, &st) < 0) {
                r = -errno;
                goto out_close;
        }
        if (st.st_size < CHUNK_OVERHEAD || st.st_size > CACHE_OBJECT_MAX) {
                r = -EBADMSG;
                goto out_bad;
        }
        if (data && (size_t) st.st_size > size) {
                r = -ENOBUFS;
                goto out_close;
        }
        if (!data) {
                data = malloc((size_t) st.st_size);
                if (!data) {
                        r = -ENOMEM;
                        goto out_close;
                }
        }
        while (len < (size_t) st.st_size) {
                size_t want = (size_t) st.st_size - len;
                ssize_t n;

                /* Direct I/O reads whole blocks: the last one ends past the end of the file (size allows it). */
                if (direct)
                        want = (want + DIRECT_ALIGN - 1) / DIRECT_ALIGN * DIRECT_ALIGN;
                n = pread(fd, data + len, want, (off_t) len);
                if (n < 0 && errno == EINTR)
                        continue;
                if (direct && ((n < 0 && errno == EINVAL) || (n >= 0 && (size_t) n < (size_t) st.st_size - len))) {
                        /* Refused (block size, alignment), or short and now unaligned: go through the page cache. */
                        direct = false;
                        if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_DIRECT) < 0) {
                                r = -errno;
                                goto out_data;
                        }
                        if (n > 0)
                                len += (size_t) n;
                        continue;
                }
                if (n < 0) {
                        r = -errno;
                        log_error("failed to read cache object %s: %s", rel, strerror(-r));
                        goto out_data;
                }
                if (n == 0)
                        break;
                len += (size_t) n;
        }
        if (len != (size_t) st.st_size || chunk_verify_tag(data, len, tag) < 0) {
                r = -EBADMSG;
                goto out_bad;
        }
        close(fd);
        use_note(c, tag);
        *buf = data;
        *ret_len = len;
        return 0;

out_bad:
        log_warning("cache object %s failed verification: quarantined, fetching it again", rel + 13);
        cache_quarantine(c, tag);
out_data:
        if (data != *buf)
                free(data);
out_close:
        close(fd);
        return r;
}

int cache_get(Cache *c, const uint8_t tag[CACHE_TAG_LEN], uint8_t **ret_object, size_t *ret_len) {
        *ret_object = NULL;
        return object_read(c, tag, ret_object, 0, ret_len);
}

int cache_get_into(Cache *c, const uint8_t tag[CACHE_TAG_LEN], void *buf, size_t size, size_t *ret_len) {
        uint8_t *data = buf;

        if (!buf)
                return -EINVAL;
        return object_read(c, tag, &data, size, ret_len);
}

/* Writes object to a new temporary file in dir/tmp; returns its malloc()ed path. */
static int tmp_write(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len, bool sync,
                     char **ret_path) {
        char hex[TAG_HEX_LEN + 1], *path = NULL;
        int fd, r;

        hex_encode(tag, CACHE_TAG_LEN, hex);
        if (asprintf(&path, "%s/tmp/%s.XXXXXX", c->dir, hex) < 0)
                return -ENOMEM;
        fd = mkostemp(path, O_CLOEXEC);
        if (fd < 0) {
                r = -errno;
                if (!is_full(r))
                        log_error("failed to create %s: %s", path, strerror(-r));
                free(path);
                return r;
        }
        r = fchmod(fd, 0644) < 0 ? -errno : 0;
        if (r >= 0)
                r = file_write_full(fd, object, len);
        if (r >= 0 && sync && fdatasync(fd) < 0)
                r = -errno;
        if (close(fd) < 0 && r >= 0)
                r = -errno;
        if (r < 0) {
                /* No room is the caller's to handle (evict and retry, or report the cache full). */
                if (!is_full(r))
                        log_error("failed to write %s: %s", path, strerror(-r));
                unlink(path);
                free(path);
                return r;
        }
        *ret_path = path;
        return 0;
}

/* tmp_write(), evicting and trying again while the file system has no room (see room_retry()). */
static int tmp_write_room(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len, bool sync,
                          int64_t keep_since, char **ret_path) {
        int round = 0, r;

        do
                r = tmp_write(c, tag, object, len, sync, ret_path);
        while (room_retry(c, r, len, keep_since, &round));
        return r;
}

/* Renames a temporary file to the object's name, creating its directories. */
static int tmp_install(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const char *tmp_path, bool sync_dir) {
        char rel[sizeof("chunks/ab/cd/") + TAG_HEX_LEN], dir[16];
        int r;

        object_relpath(tag, rel);
        memcpy(dir, rel, 12);
        dir[12] = 0;
        for (int round = 0; renameat(AT_FDCWD, tmp_path, c->dir_fd, rel) < 0;) {
                r = -errno;
                if (r == -ENOENT) {
                        r = mkdir_p_at(c->dir_fd, dir);
                        if (r >= 0)
                                continue;
                }
                /* A new directory (or its entry) needs a block: make room as for an object. */
                if (room_retry(c, r, 4096, 0, &round))
                        continue;
                log_error("failed to rename %s to %s/%s: %s", tmp_path, c->dir, rel, strerror(-r));
                return r;
        }
        if (sync_dir) {
                r = file_sync_at(c->dir_fd, dir);
                if (r < 0) {
                        log_error("failed to sync %s/%s: %s", c->dir, dir, strerror(-r));
                        return r;
                }
        }
        return 0;
}

static int put(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len, bool durable,
               int64_t keep_since) {
        char *tmp = NULL;
        int r;

        r = room_for(c, len, keep_since);
        if (r < 0)
                return r;
        r = tmp_write_room(c, tag, object, len, durable, keep_since, &tmp);
        if (r >= 0) {
                r = tmp_install(c, tag, tmp, durable);
                if (r < 0)
                        unlink(tmp);
                free(tmp);
        }
        if (r < 0)
                pending_drop(c, len);
        else
                index_insert(c, tag, len, keep_since);
        return r;
}

int cache_put(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len, bool durable) {
        return put(c, tag, object, len, durable, 0);
}

int cache_put_keep(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len, int64_t keep_since) {
        return put(c, tag, object, len, false, keep_since);
}

void cache_touch(Cache *c, const uint8_t tag[CACHE_TAG_LEN]) {
        use_note(c, tag);
}

int64_t cache_now_us(void) {
        return now_us();
}

int cache_batch_new(Cache *c, bool pin, CacheBatch **ret) {
        CacheBatch *b = calloc(1, sizeof(*b));

        if (!b)
                return -ENOMEM;
        b->cache = c;
        b->pin = pin;
        *ret = b;
        return 0;
}

void cache_batch_keep_since(CacheBatch *b, int64_t keep_since) {
        b->keep_since = keep_since;
}

static int batch_add(CacheBatch *b, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len,
                     bool reserved) {
        BatchEntry *e;
        int r;

        if (b->n == b->capacity) {
                size_t capacity = b->capacity ? b->capacity * 2 : 16;
                BatchEntry *p = realloc(b->entries, capacity * sizeof(*p));

                if (!p)
                        return -ENOMEM;
                b->entries = p;
                b->capacity = capacity;
        }
        e = &b->entries[b->n];
        memcpy(e->tag, tag, CACHE_TAG_LEN);
        e->len = len;
        e->indexed = false;
        r = reserved ? 0 : room_for(b->cache, len, b->keep_since);
        if (r < 0)
                return r;
        r = tmp_write_room(b->cache, tag, object, len, false, b->keep_since, &e->tmp_path);
        if (r < 0) {
                if (!reserved)
                        pending_drop(b->cache, len);
                return r;
        }
        b->n++;
        return 0;
}

int cache_batch_add(CacheBatch *b, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len) {
        return batch_add(b, tag, object, len, false);
}

int cache_batch_add_reserved(CacheBatch *b, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len,
                             uint64_t reserved) {
        Cache *c = b->cache;
        int r = batch_add(b, tag, object, len, true);

        /* Written (or not): the object holds its room now (pending until indexed), or the caller reserves
         * again. */
        pthread_mutex_lock(&c->lock);
        c->reserved -= fs_cost(reserved) < c->reserved ? fs_cost(reserved) : c->reserved;
        if (r >= 0)
                c->pending += len;
        pthread_mutex_unlock(&c->lock);
        return r;
}

/*
 * A small batch (a guest flush of a few chunks) syncs its files and their directories one by one; a large
 * one (the background flusher, a suspend) uses one syncfs() for every temporary file and one more for
 * every rename, which costs the same for 4 or 4000 files but also flushes whatever else is on the file
 * system.
 */
int cache_batch_commit(CacheBatch *b) {
        Cache *c = b->cache;
        bool small = b->n <= BATCH_SMALL;
        int r;

        if (b->n == 0)
                return 0;
        for (size_t i = 0; small && i < b->n; i++) {
                r = file_sync_at(AT_FDCWD, b->entries[i].tmp_path);
                if (r < 0) {
                        log_error("failed to sync %s: %s", b->entries[i].tmp_path, strerror(-r));
                        return r;
                }
        }
        if (!small && syncfs(c->dir_fd) < 0) {
                r = -errno;
                log_error("failed to sync cache %s: %s", c->dir, strerror(-r));
                return r;
        }
        /* These objects are the only copy of acknowledged writes until they are uploaded: pinned before
         * their names exist, so that no evictor (in any process) can remove them. */
        if (b->pin) {
                uint8_t (*tags)[CACHE_TAG_LEN] = malloc(b->n * sizeof(*tags));

                if (!tags)
                        return -ENOMEM;
                for (size_t i = 0; i < b->n; i++)
                        memcpy(tags[i], b->entries[i].tag, CACHE_TAG_LEN);
                r = cache_pin(c, (const uint8_t (*)[CACHE_TAG_LEN]) tags, b->n);
                free(tags);
                if (r < 0)
                        return r;
        }
        for (size_t i = 0; i < b->n; i++) {
                r = tmp_install(c, b->entries[i].tag, b->entries[i].tmp_path, small);
                if (r < 0)
                        return r;
                free(b->entries[i].tmp_path);
                b->entries[i].tmp_path = NULL;
        }
        if (!small && syncfs(c->dir_fd) < 0) {
                r = -errno;
                log_error("failed to sync cache %s: %s", c->dir, strerror(-r));
                return r;
        }
        for (size_t i = 0; i < b->n; i++) {
                index_insert(c, b->entries[i].tag, b->entries[i].len, b->keep_since);
                b->entries[i].indexed = true;
        }
        return 0;
}

CacheBatch *cache_batch_free(CacheBatch *b) {
        if (!b)
                return NULL;
        for (size_t i = 0; i < b->n; i++) {
                if (b->entries[i].tmp_path) {
                        unlink(b->entries[i].tmp_path);
                        free(b->entries[i].tmp_path);
                }
                if (!b->entries[i].indexed)
                        pending_drop(b->cache, b->entries[i].len);
        }
        free(b->entries);
        free(b);
        return NULL;
}
