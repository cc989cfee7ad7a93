/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Tests for cache.c: put/get (also into a caller's buffer, directly and through the page cache),
 * verification and quarantine of a damaged object, batches (nothing visible before commit), rebuilding a
 * lost or damaged index from the files, and eviction under a size limit (least recently used first, never
 * a pinned object, pins shared by two handles like two processes).
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

#include "cache.h"
#include "chunk.h"
#include "crypto.h"
#include "hex.h"

static const uint8_t secret[CHUNK_SECRET_LEN] = { 7 };

typedef struct Fixture {
        char dir[64];
} Fixture;

static int setup(void **state) {
        Fixture *f = calloc(1, sizeof(*f));

        strcpy(f->dir, "/tmp/test_cache.XXXXXX");
        if (!mkdtemp(f->dir))
                return -1;
        *state = f;
        return 0;
}

static int teardown(void **state) {
        Fixture *f = *state;
        char cmd[128];

        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->dir);
        if (system(cmd) != 0)
                return -1;
        free(f);
        return 0;
}

/* An encoded chunk object of n bytes of pattern p. */
static void make_object(uint8_t p, size_t n, uint8_t **ret, size_t *ret_len, uint8_t tag[CHUNK_TAG_LEN]) {
        uint8_t *plain = malloc(n), key[CHUNK_KEY_LEN], flags;

        for (size_t i = 0; i < n; i++)
                plain[i] = (uint8_t) (p + i * 31 + (i >> 7));
        *ret = malloc(chunk_object_max_len(n));
        assert_int_equal(chunk_encode(plain, n, secret, 3, *ret, ret_len, tag, key, &flags), 0);
        free(plain);
}

static void object_path(const Fixture *f, const uint8_t tag[CHUNK_TAG_LEN], char *buf, size_t size) {
        char hex[65];

        hex_encode(tag, CHUNK_TAG_LEN, hex);
        snprintf(buf, size, "%s/chunks/%.2s/%.2s/%s", f->dir, hex, hex + 2, hex);
}

static void test_put_get(void **state) {
        Fixture *f = *state;
        uint8_t tag[CHUNK_TAG_LEN], *obj, *back;
        size_t len, back_len;
        uint64_t objects, bytes;
        Cache *c;

        assert_int_equal(cache_open(f->dir, &c), 0);
        make_object(1, 5000, &obj, &len, tag);
        assert_false(cache_has(c, tag));
        assert_int_equal(cache_get(c, tag, &back, &back_len), -ENOENT);
        assert_int_equal(cache_put(c, tag, obj, len, true), 0);
        assert_true(cache_has(c, tag));
        assert_int_equal(cache_get(c, tag, &back, &back_len), 0);
        assert_int_equal(back_len, len);
        assert_memory_equal(back, obj, len);
        free(back);
        /* Replacing with the same bytes is harmless. */
        assert_int_equal(cache_put(c, tag, obj, len, false), 0);
        assert_int_equal(cache_usage(c, &objects, &bytes), 0);
        assert_int_equal(objects, 1);
        assert_int_equal(bytes, len);
        free(obj);
        cache_free(c);
}

static void test_damaged_object_is_quarantined(void **state) {
        Fixture *f = *state;
        uint8_t tag[CHUNK_TAG_LEN], *obj, *back = NULL;
        size_t len, back_len;
        char path[256], qdir[128];
        FILE *file;
        Cache *c;

        assert_int_equal(cache_open(f->dir, &c), 0);
        make_object(2, 4096, &obj, &len, tag);
        assert_int_equal(cache_put(c, tag, obj, len, true), 0);
        object_path(f, tag, path, sizeof(path));
        file = fopen(path, "r+b");
        assert_non_null(file);
        fseek(file, (long) len / 2, SEEK_SET);
        fputc(obj[len / 2] ^ 0x01, file);
        fclose(file);

        assert_int_equal(cache_get(c, tag, &back, &back_len), -EBADMSG);
        assert_null(back);
        assert_false(cache_has(c, tag));
        snprintf(qdir, sizeof(qdir), "%s/quarantine", f->dir);
        snprintf(path, sizeof(path), "ls '%s' | grep -q .", qdir);
        assert_int_equal(system(path), 0);
        /* A truncated file is caught too. */
        assert_int_equal(cache_put(c, tag, obj, len - 1, false), 0);
        assert_int_equal(cache_get(c, tag, &back, &back_len), -EBADMSG);
        free(obj);
        cache_free(c);
}

/* cache_get_into(): into the caller's buffer (page-aligned: direct I/O; or not), -ENOBUFS when it is too
 * small, and the same verification and quarantine as cache_get(). */
static void test_get_into_buffer(void **state) {
        Fixture *f = *state;
        uint8_t tag[CHUNK_TAG_LEN], *obj, *buf = NULL;
        size_t len, size, got = 0;
        char path[256];
        FILE *file;
        Cache *c;

        assert_int_equal(cache_open(f->dir, &c), 0);
        make_object(3, 20000, &obj, &len, tag);
        size = (len + 4095) / 4096 * 4096;
        assert_int_equal(posix_memalign((void **) &buf, 4096, size + 4096), 0);
        assert_int_equal(cache_get_into(c, tag, buf, size, &got), -ENOENT);
        /* Not synced: a direct read must still see what is only in the page cache. */
        assert_int_equal(cache_put(c, tag, obj, len, false), 0);
        assert_int_equal(cache_get_into(c, tag, buf, size, &got), 0);
        assert_int_equal(got, len);
        assert_memory_equal(buf, obj, len);
        memset(buf, 0, size + 4096);
        assert_int_equal(cache_get_into(c, tag, buf + 1, size, &got), 0);
        assert_int_equal(got, len);
        assert_memory_equal(buf + 1, obj, len);
        assert_int_equal(cache_get_into(c, tag, buf, len - 1, &got), -ENOBUFS);
        assert_true(cache_has(c, tag));

        object_path(f, tag, path, sizeof(path));
        file = fopen(path, "r+b");
        assert_non_null(file);
        fseek(file, 100, SEEK_SET);
        fputc(obj[100] ^ 0x80, file);
        fclose(file);
        assert_int_equal(cache_get_into(c, tag, buf, size, &got), -EBADMSG);
        assert_false(cache_has(c, tag));
        free(buf);
        free(obj);
        cache_free(c);
}

static void test_batch_visible_only_after_commit(void **state) {
        Fixture *f = *state;
        uint8_t tags[3][CHUNK_TAG_LEN], *objs[3];
        size_t lens[3];
        CacheBatch *b;
        Cache *c;

        assert_int_equal(cache_open(f->dir, &c), 0);
        for (int i = 0; i < 3; i++)
                make_object((uint8_t) (10 + i), 8192, &objs[i], &lens[i], tags[i]);

        assert_int_equal(cache_batch_new(c, false, &b), 0);
        for (int i = 0; i < 3; i++)
                assert_int_equal(cache_batch_add(b, tags[i], objs[i], lens[i]), 0);
        for (int i = 0; i < 3; i++)
                assert_false(cache_has(c, tags[i]));
        assert_int_equal(cache_batch_commit(b), 0);
        cache_batch_free(b);
        for (int i = 0; i < 3; i++)
                assert_true(cache_has(c, tags[i]));

        /* An abandoned batch leaves nothing behind, not even temporary files. */
        uint8_t tag[CHUNK_TAG_LEN], *obj;
        size_t len;
        char cmd[160];

        make_object(99, 8192, &obj, &len, tag);
        assert_int_equal(cache_batch_new(c, false, &b), 0);
        assert_int_equal(cache_batch_add(b, tag, obj, len), 0);
        cache_batch_free(b);
        assert_false(cache_has(c, tag));
        snprintf(cmd, sizeof(cmd), "test -z \"$(ls -A '%s/tmp')\"", f->dir);
        assert_int_equal(system(cmd), 0);

        for (int i = 0; i < 3; i++)
                free(objs[i]);
        free(obj);
        cache_free(c);
}

static void test_index_rebuilt_when_lost_or_damaged(void **state) {
        Fixture *f = *state;
        uint8_t tag[CHUNK_TAG_LEN], *obj;
        size_t len, total = 0;
        uint64_t objects, bytes;
        char path[160];
        FILE *file;
        Cache *c;

        assert_int_equal(cache_open(f->dir, &c), 0);
        for (int i = 0; i < 5; i++) {
                make_object((uint8_t) (40 + i), 4096 + (size_t) i * 1000, &obj, &len, tag);
                assert_int_equal(cache_put(c, tag, obj, len, false), 0);
                total += len;
                free(obj);
        }
        cache_free(c);

        snprintf(path, sizeof(path), "%s/index.sqlite", f->dir);
        assert_int_equal(unlink(path), 0);
        assert_int_equal(cache_open(f->dir, &c), 0);
        assert_int_equal(cache_usage(c, &objects, &bytes), 0);
        assert_int_equal(objects, 5);
        assert_int_equal(bytes, total);
        cache_free(c);

        /* Garbage where the index was: moved aside and rebuilt. */
        file = fopen(path, "wb");
        fputs("this is not an sqlite database, not even close; it is long enough to look like one", file);
        fclose(file);
        assert_int_equal(cache_open(f->dir, &c), 0);
        assert_int_equal(cache_usage(c, &objects, &bytes), 0);
        assert_int_equal(objects, 5);
        cache_free(c);
}

/* Five objects put in order 0..4; then 0 is read (most recently used) and 1 pinned (a pending upload). */
static void test_eviction_order_and_pins(void **state) {
        Fixture *f = *state;
        uint8_t *obj[5], tag[5][CHUNK_TAG_LEN], *got;
        size_t len[5], got_len;
        uint64_t total = 0;
        CacheStatus st;
        Cache *c, *other;

        assert_int_equal(cache_open(f->dir, &c), 0);
        assert_int_equal(cache_set_owner(c, "/state/a"), 0);
        for (int i = 0; i < 5; i++) {
                make_object((uint8_t) (i * 17 + 1), 4096, &obj[i], &len[i], tag[i]);
                assert_int_equal(cache_put(c, tag[i], obj[i], len[i], false), 0);
                total += len[i];
                usleep(2000);          /* distinct last-use times */
        }
        assert_int_equal(cache_get(c, tag[0], &got, &got_len), 0);
        free(got);
        assert_int_equal(cache_pin(c, (const uint8_t (*)[CHUNK_TAG_LEN]) tag[1], 1), 0);

        /* Another handle on the same directory (another process) must respect the first one's pin. */
        assert_int_equal(cache_open(f->dir, &other), 0);
        assert_int_equal(cache_set_owner(other, "/state/b"), 0);
        assert_int_equal(cache_status(other, &st), 0);
        assert_int_equal(st.objects, 5);
        assert_int_equal(st.pinned, 1);

        /* Room for three: 90 % of the limit leaves two after eviction: the oldest unpinned go, 2 then 3. */
        cache_free(c);         /* its noted use of 0 reaches the index */
        assert_int_equal(cache_open(f->dir, &c), 0);
        assert_int_equal(cache_set_owner(c, "/state/a"), 0);
        assert_int_equal(cache_set_limit(other, total - len[0] - len[1] / 2), 0);
        assert_int_equal(cache_evict(other), 0);
        assert_true(cache_has(c, tag[0]));
        assert_true(cache_has(c, tag[1]));
        assert_false(cache_has(c, tag[2]));
        assert_false(cache_has(c, tag[3]));
        assert_true(cache_has(c, tag[4]));
        assert_int_equal(cache_status(other, &st), 0);
        assert_int_equal(st.objects, 3);
        assert_int_equal(st.evictions, 2);
        assert_int_equal(cache_evictions_total(c), 2);

        /* Down to almost nothing: everything unpinned goes, the pinned object stays. */
        assert_int_equal(cache_set_limit(other, 1), 0);
        assert_int_equal(cache_evict(other), 0);
        assert_true(cache_has(c, tag[1]));
        assert_false(cache_has(c, tag[0]));
        assert_false(cache_has(c, tag[4]));
        assert_int_equal(cache_get(c, tag[1], &got, &got_len), 0);
        assert_memory_equal(got, obj[1], len[1]);
        free(got);

        /* Pins belong to their owner: b replacing its pins leaves a's; a replacing its own by none frees 1. */
        assert_int_equal(cache_pins_replace(other, NULL, 0), 0);
        assert_int_equal(cache_evict(other), 0);
        assert_true(cache_has(c, tag[1]));
        assert_int_equal(cache_pins_replace(c, NULL, 0), 0);
        assert_int_equal(cache_evict(other), 0);
        assert_false(cache_has(c, tag[1]));

        cache_free(other);
        cache_free(c);
        for (int i = 0; i < 5; i++)
                free(obj[i]);
}

/* Dropping a parcel's objects removes them and their index rows, but never a pinned one (another parcel's
 * writes not yet uploaded), whoever pinned it; absent tags are no error. */
static void test_drop_spares_pinned_objects(void **state) {
        Fixture *f = *state;
        uint8_t *obj[4], tag[4][CHUNK_TAG_LEN];
        size_t len[4], pinned = 9;
        uint64_t bytes = 0;
        CacheStatus st;
        Cache *c, *other;

        assert_int_equal(cache_open(f->dir, &c), 0);
        assert_int_equal(cache_open(f->dir, &other), 0);
        assert_int_equal(cache_set_owner(other, "/state/b"), 0);
        for (int i = 0; i < 4; i++) {
                make_object((uint8_t) (i * 13 + 5), 4096, &obj[i], &len[i], tag[i]);
                if (i < 3)
                        assert_int_equal(cache_put(c, tag[i], obj[i], len[i], false), 0);
        }
        assert_int_equal(cache_pin(other, (const uint8_t (*)[CHUNK_TAG_LEN]) tag[1], 1), 0);
        assert_int_equal(cache_drop(c, (const uint8_t (*)[CHUNK_TAG_LEN]) tag, 4, &bytes, &pinned), 2);
        assert_int_equal(bytes, len[0] + len[2]);
        assert_int_equal(pinned, 1);
        assert_false(cache_has(c, tag[0]));
        assert_true(cache_has(c, tag[1]));
        assert_false(cache_has(c, tag[2]));
        assert_int_equal(cache_status(c, &st), 0);
        assert_int_equal(st.objects, 1);
        assert_int_equal(st.bytes, len[1]);
        /* Once unpinned it may go too. */
        assert_int_equal(cache_pins_replace(other, NULL, 0), 0);
        assert_int_equal(cache_drop(c, (const uint8_t (*)[CHUNK_TAG_LEN]) tag, 4, &bytes, &pinned), 1);
        assert_int_equal(pinned, 0);
        assert_false(cache_has(c, tag[1]));
        cache_free(other);
        cache_free(c);
        for (int i = 0; i < 4; i++)
                free(obj[i]);
}

/* An object of n incompressible bytes (so that it takes about n bytes in the cache). */
static void make_random_object(uint32_t seed, size_t n, uint8_t **ret, size_t *ret_len, uint8_t tag[CHUNK_TAG_LEN]) {
        uint8_t *plain = malloc(n), key[CHUNK_KEY_LEN], flags;
        uint32_t x = seed * 2654435761u + 1;

        for (size_t i = 0; i < n; i++) {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                plain[i] = (uint8_t) x;
        }
        *ret = malloc(chunk_object_max_len(n));
        assert_int_equal(chunk_encode(plain, n, secret, 3, *ret, ret_len, tag, key, &flags), 0);
        free(plain);
}

/* Objects first..first+n-1, each of 4096 incompressible bytes, with distinct last-use times. */
static void put_objects(Cache *c, int first, int n, uint8_t *obj[], size_t len[], uint8_t tag[][CHUNK_TAG_LEN]) {
        for (int i = first; i < first + n; i++) {
                make_random_object((uint32_t) i + 1, 4096, &obj[i], &len[i], tag[i]);
                assert_int_equal(cache_put(c, tag[i], obj[i], len[i], false), 0);
                usleep(2000);
        }
}

/* A put that does not fit under the limit evicts the least recently used objects itself, at once. */
static void test_put_makes_room_under_the_limit(void **state) {
        Fixture *f = *state;
        uint8_t *obj[12], tag[12][CHUNK_TAG_LEN];
        size_t len[12];
        CacheStatus st;
        Cache *c;

        assert_int_equal(cache_open(f->dir, &c), 0);
        put_objects(c, 0, 4, obj, len, tag);
        /* Room for about six (whole blocks each): the evictor thread starts too, but the puts do not wait for it. */
        assert_int_equal(cache_set_limit(c, 6 * 8192), 0);
        put_objects(c, 4, 8, obj, len, tag);
        assert_int_equal(cache_status(c, &st), 0);
        assert_true(st.bytes <= 6 * 8192);
        assert_true(st.evictions > 0);
        assert_int_equal(st.refused, 0);
        assert_false(cache_has(c, tag[0]));
        assert_true(cache_has(c, tag[11]));
        assert_true(cache_has(c, tag[10]));
        cache_free(c);
        for (int i = 0; i < 12; i++)
                free(obj[i]);
}

/*
 * A hoard (cache_put_keep()) evicts only what was used before it started: older objects make room, then
 * it is refused with ENOSPC rather than push out what it stored or found (touched) itself.  Pinned objects
 * and reservations are never given up for it.
 */
static void test_hoard_keeps_its_own_and_reservations_hold(void **state) {
        Fixture *f = *state;
        uint8_t *obj[16], tag[16][CHUNK_TAG_LEN], *extra, extra_tag[CHUNK_TAG_LEN];
        size_t len[16], extra_len;
        int64_t start;
        CacheStatus st;
        CacheBatch *b;
        Cache *c;
        int stored = 0, r = 0;

        assert_int_equal(cache_open(f->dir, &c), 0);
        assert_int_equal(cache_set_owner(c, "/state/a"), 0);
        put_objects(c, 0, 4, obj, len, tag);                     /* 0..3: older than the hoard */
        assert_int_equal(cache_pin(c, (const uint8_t (*)[CHUNK_TAG_LEN]) tag[3], 1), 0);
        assert_int_equal(cache_set_limit(c, 10 * 4300), 0);    /* room for ten */
        start = cache_now_us();
        cache_touch(c, tag[2]);                                  /* found by the hoard: kept */
        for (int i = 4; i < 16 && r == 0; i++) {
                make_random_object((uint32_t) i + 1, 4096, &obj[i], &len[i], tag[i]);
                r = cache_put_keep(c, tag[i], obj[i], len[i], start);
                stored += r == 0;
        }
        assert_int_equal(r, -ENOSPC);
        assert_false(cache_has(c, tag[0]));
        assert_false(cache_has(c, tag[1]));
        assert_true(cache_has(c, tag[2]));
        assert_true(cache_has(c, tag[3]));
        for (int i = 4; i < 4 + stored; i++)
                assert_true(cache_has(c, tag[i]));
        assert_int_equal(cache_status(c, &st), 0);
        assert_true(st.bytes <= 10 * 4300);
        assert_int_equal(stored, 8);                             /* ten, less the two it kept */
        assert_int_equal(st.pinned_bytes, len[3]);
        assert_int_equal(st.own_pinned_bytes, len[3]);
        assert_true(st.refused > 0);

        /* A reservation takes room from others: a plain put evicts rather than eat into it... */
        assert_int_equal(cache_set_limit(c, st.bytes + 8192), 0);
        assert_int_equal(cache_reserve(c, 4096), 0);
        make_random_object(222, 4096, &extra, &extra_len, extra_tag);
        assert_int_equal(cache_put(c, extra_tag, extra, extra_len, false), 0);
        assert_int_equal(cache_status(c, &st), 0);
        assert_int_equal(st.reserved, 4096);
        assert_true(st.bytes + st.reserved <= st.limit);
        /* ... and is spent by the object it was held for (the flush's batch), which needs no more room. */
        assert_int_equal(cache_pin(c, (const uint8_t (*)[CHUNK_TAG_LEN]) extra_tag, 1), 0);
        free(extra);
        make_random_object(223, 4096, &extra, &extra_len, extra_tag);
        assert_int_equal(cache_batch_new(c, true, &b), 0);
        assert_int_equal(cache_batch_add_reserved(b, extra_tag, extra, extra_len, 4096), 0);
        assert_int_equal(cache_batch_commit(b), 0);
        cache_batch_free(b);
        assert_int_equal(cache_status(c, &st), 0);
        assert_int_equal(st.reserved, 0);
        /* Everything left is pinned or the hoard's own: nothing more can be reserved under the limit. */
        assert_int_equal(cache_set_limit(c, st.bytes), 0);
        assert_int_equal(cache_pin(c, (const uint8_t (*)[CHUNK_TAG_LEN]) tag, (size_t) (4 + stored)), 0);
        assert_int_equal(cache_pin(c, (const uint8_t (*)[CHUNK_TAG_LEN]) extra_tag, 1), 0);
        assert_int_equal(cache_reserve(c, 4096), -ENOSPC);
        /* Unpinned, the objects are clean again: a reservation evicts them. */
        assert_int_equal(cache_pins_replace(c, NULL, 0), 0);
        assert_int_equal(cache_reserve(c, 4096), 0);
        cache_unreserve(c, 4096);
        assert_int_equal(cache_status(c, &st), 0);
        assert_int_equal(st.reserved, 0);
        cache_free(c);
        free(extra);
        for (int i = 0; i < 4 + stored + 1; i++)
                free(obj[i]);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test_setup_teardown(test_put_get, setup, teardown),
                cmocka_unit_test_setup_teardown(test_damaged_object_is_quarantined, setup, teardown),
                cmocka_unit_test_setup_teardown(test_get_into_buffer, setup, teardown),
                cmocka_unit_test_setup_teardown(test_batch_visible_only_after_commit, setup, teardown),
                cmocka_unit_test_setup_teardown(test_index_rebuilt_when_lost_or_damaged, setup, teardown),
                cmocka_unit_test_setup_teardown(test_eviction_order_and_pins, setup, teardown),
                cmocka_unit_test_setup_teardown(test_drop_spares_pinned_objects, setup, teardown),
                cmocka_unit_test_setup_teardown(test_put_makes_room_under_the_limit, setup, teardown),
                cmocka_unit_test_setup_teardown(test_hoard_keeps_its_own_and_reservations_hold, setup, teardown),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
