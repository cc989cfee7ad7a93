/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CACHE_TAG_LEN 32

typedef struct Cache Cache;
typedef struct CacheBatch CacheBatch;

/*
 * Opens (creating if needed) the persistent chunk cache in dir: chunk objects (ciphertext only) in
 * dir/chunks/ab/cd/<tag hex>, the same layout as a parcel store, so that a cache directory can serve as
 * another machine's lookaside source.  The sqlite index dir/index.sqlite is rebuilt from the files if it
 * is missing or damaged.
 */
int cache_open(const char *dir, Cache **ret);
Cache *cache_free(Cache *c);

const char *cache_dir(const Cache *c);

/*
 * Reads the object named tag and verifies its SHA-256.  Returns -ENOENT if absent, and -EBADMSG if the
 * file failed verification: it has then been moved to dir/quarantine/ and the caller fetches it again.
 * The object is malloc()ed.
 */
int cache_get(Cache *c, const uint8_t tag[CACHE_TAG_LEN], uint8_t **ret_object, size_t *ret_len);

/*
 * The same into buf (size bytes, reused by the caller); -ENOBUFS if the file is larger (nothing moved).
 * With buf and size multiples of 4096 the object is read with O_DIRECT where the file system takes it:
 * the caller keeps what it decodes, so the ciphertext need not take page cache as well.
 */
int cache_get_into(Cache *c, const uint8_t tag[CACHE_TAG_LEN], void *buf, size_t size, size_t *ret_len);

/* True if an object file for tag exists (not verified). */
bool cache_has(Cache *c, const uint8_t tag[CACHE_TAG_LEN]);

/* Notes a use of tag (LRU order) without reading it: a hoard that finds an object in the cache keeps it. */
void cache_touch(Cache *c, const uint8_t tag[CACHE_TAG_LEN]);

/* Now, in the clock of the index's last-use times (microseconds), for cache_put_keep() and batches. */
int64_t cache_now_us(void);

/*
 * Stores an object the caller has verified (or just encoded) under its tag: temporary file, then rename.
 * With durable, the file is fsync()ed before and its directory after the rename.  An existing file is
 * replaced, never trusted: a crash can leave a torn file under a tag name that is only found on read.
 *
 * Room: a new object must fit under the limit (with the reservations, see cache_reserve()) and on the
 * file system with every reservation and a small floor still free.  If it does not, least recently used
 * unpinned objects are evicted first; -ENOSPC only when that cannot make room.  cache_put_keep() evicts
 * only objects last used before keep_since (cache_now_us() at a hoard's start), so that a hoard never
 * pushes out what it has just stored: it reports the cache full instead.
 */
int cache_put(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len, bool durable);
int cache_put_keep(Cache *c, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len, int64_t keep_since);

/*
 * Reservations hold room for objects that must be writable later: dirty chunks, whose flush must never
 * fail for lack of space after their write was acknowledged.  cache_reserve() takes bytes of room (under
 * the limit and on the file system, evicting as cache_put() does) or fails with -ENOSPC; other writers
 * (reads, hoards) must leave reserved room free.  A reservation is given back with cache_unreserve(), or
 * by cache_batch_add_reserved() once the object it was held for is written.
 */
int cache_reserve(Cache *c, uint64_t bytes);
void cache_unreserve(Cache *c, uint64_t bytes);

/* Moves a bad object out of the way (to dir/quarantine/<tag>.<time>) and drops it from the index. */
int cache_quarantine(Cache *c, const uint8_t tag[CACHE_TAG_LEN]);

/*
 * Removes the objects named by tags that no process has pinned (`isr hoard --drop`: free one parcel's
 * objects), in one write transaction as eviction does, so that a pin cannot land between the check and the
 * unlink.  Returns how many were removed (their bytes in *ret_bytes, the pinned ones kept counted in
 * *ret_pinned; absent ones count in neither) or a negative errno.
 */
int cache_drop(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n, uint64_t *ret_bytes, size_t *ret_pinned);

/*
 * Batches make many new objects durable together: cache_batch_add() writes a temporary file,
 * cache_batch_commit() syncs the files (one by one, or the whole file system for a large batch), renames
 * every file into place and syncs the directories.  After commit returns, every object of the batch survives a crash; before, none is visible
 * under its name.  Freeing an uncommitted batch removes its temporary files.  With pin, commit pins every
 * object (see cache_pin()) before it becomes visible.
 */
int cache_batch_new(Cache *c, bool pin, CacheBatch **ret);
/* Objects of this batch evict only objects last used before keep_since (see cache_put_keep()). */
void cache_batch_keep_since(CacheBatch *b, int64_t keep_since);
int cache_batch_add(CacheBatch *b, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len);
/* An object whose room is reserved: written without a room check; gives back reserved bytes when the
 * temporary file is written (or failed). */
int cache_batch_add_reserved(CacheBatch *b, const uint8_t tag[CACHE_TAG_LEN], const void *object, size_t len,
                             uint64_t reserved);
int cache_batch_commit(CacheBatch *b);
CacheBatch *cache_batch_free(CacheBatch *b);

/* Rebuilds the index from the object files (run automatically when the index is lost or damaged). */
int cache_rebuild_index(Cache *c);

/* Objects and bytes according to the index. */
int cache_usage(Cache *c, uint64_t *ret_objects, uint64_t *ret_bytes);

typedef struct CacheStatus {
        uint64_t objects, bytes;         /* according to the index */
        uint64_t limit;                  /* bytes, 0: no limit */
        uint64_t evictions;              /* objects evicted by this process */
        uint64_t evictions_total;        /* by every process sharing the cache, ever */
        uint64_t pinned;                 /* objects that must not be evicted (any owner) */
        uint64_t pinned_bytes;           /* their bytes; the rest of bytes is clean: it can be evicted */
        uint64_t own_pinned_bytes;       /* pinned by this owner as pending uploads (see cache_set_owner()) */
        uint64_t reserved;               /* bytes reserved by this process (cache_reserve()) */
        uint64_t fs_free, fs_size;       /* the file system under the cache: available to us, and its size */
        uint64_t room;                   /* bytes of new objects that fit after evicting every clean object */
        uint64_t refused;                /* writes and reservations refused for lack of room (this process) */
} CacheStatus;

int cache_status(Cache *c, CacheStatus *ret);
uint64_t cache_evictions_total(Cache *c);

/*
 * Size limit: with limit > 0, a background thread evicts least recently used objects (last read or
 * written, recorded in the index in batches) until the cache is below 90 % of limit, whenever it is above
 * it.  Pinned objects are never evicted.  cache_evict() runs one pass now (tests).
 */
int cache_set_limit(Cache *c, uint64_t limit);
int cache_evict(Cache *c);

/* A size limit as the programs take it: "512" (MiB), "512M", "20G", "1T", "64K" (also "20GiB", "20GB");
 * returns bytes or -EINVAL. */
int64_t cache_size_parse(const char *text);

/*
 * Pins are rows (tag, owner) in the shared index: an object pinned by any owner is never evicted.  The
 * owner names the pinning vulpes (its state directory); cache_pins_replace() replaces every pin of this
 * owner by tags in one transaction, so that a starting vulpes pins exactly its pending uploads again
 * (a pin left behind by a crash, or lost with a damaged index, is corrected) without a moment unpinned.
 */
int cache_set_owner(Cache *c, const char *owner);
int cache_pin(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n);
int cache_unpin(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n);
int cache_pins_replace(Cache *c, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n);
/* The same for another owner name (NULL tags with n 0: drop every pin of that owner). */
int cache_pins_replace_owner(Cache *c, const char *owner, const uint8_t (*tags)[CACHE_TAG_LEN], size_t n);
