/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Tests for image.c without FUSE or a server: read-modify-write against a model (unaligned, chunk-crossing,
 * the short last chunk), flush to cache and keyring and reopening from them, all-zero chunks losing their
 * record, punched holes (whole chunks dropped unread, edges zeroed; no room needed for them), the RAM bound, upload bookkeeping, a definitive error for a chunk that exists nowhere, the
 * resume pack, and the trace line format.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "cache.h"
#include "chunk.h"
#include "hex.h"
#include "image.h"
#include "keyring.h"
#include "log.h"
#include "pack.h"
#include "stats.h"
#include "trace.h"

#define CS 4096u
#define IMAGE_BYTES (20 * CS + 1536)     /* 21 chunks, the last one short */

static const uint8_t keys[64] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, [40] = 0x55 };

typedef struct Fixture {
        char dir[64];
        char keyring[128];
        char cache_dir[128];
        Stats stats;
        Trace *trace;
        Cache *cache;
        uint8_t model[IMAGE_BYTES];
} Fixture;

static int setup(void **state) {
        Fixture *f = calloc(1, sizeof(*f));
        Keyring *k;

        strcpy(f->dir, "/tmp/test_image.XXXXXX");
        if (!mkdtemp(f->dir))
                return -1;
        snprintf(f->keyring, sizeof(f->keyring), "%s/keyring.disk", f->dir);
        snprintf(f->cache_dir, sizeof(f->cache_dir), "%s/cache", f->dir);
        if (keyring_create(f->keyring, CS, IMAGE_BYTES, &k) < 0)
                return -1;
        keyring_free(k);
        if (trace_new(&f->trace) < 0 || cache_open(f->cache_dir, &f->cache) < 0)
                return -1;
        *state = f;
        return 0;
}

static int teardown(void **state) {
        Fixture *f = *state;
        char cmd[128];

        cache_free(f->cache);
        trace_free(f->trace);
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->dir);
        if (system(cmd) != 0)
                return -1;
        free(f);
        return 0;
}

static Image *open_image(Fixture *f, uint64_t ram_limit) {
        ImageSources sources = {
                .cache = f->cache,
                .stats = &f->stats,
                .trace = f->trace,
                .parcel_key = keys,
                .secret = keys + 32,
        };
        Image *img = NULL;

        assert_int_equal(image_open("disk", f->keyring, &sources, ram_limit, 3600000, &img), 0);
        return img;
}

static void check_all(Image *img, const uint8_t *model) {
        static uint8_t buf[IMAGE_BYTES];

        assert_int_equal(image_read(img, buf, IMAGE_BYTES, 0), IMAGE_BYTES);
        assert_memory_equal(buf, model, IMAGE_BYTES);
}

static void test_read_modify_write_against_model(void **state) {
        Fixture *f = *state;
        uint8_t buf[3 * CS + 100];
        Image *img = open_image(f, 64 * CS);
        unsigned seed = 1;

        assert_int_equal(image_size(img), IMAGE_BYTES);
        assert_int_equal(image_chunk_count(img), 21);
        check_all(img, f->model);

        for (int step = 0; step < 300; step++) {
                uint64_t off = (uint64_t) rand_r(&seed) % IMAGE_BYTES;
                size_t len = 1 + (size_t) rand_r(&seed) % sizeof(buf);

                if (len > IMAGE_BYTES - off)
                        len = IMAGE_BYTES - off;
                if (rand_r(&seed) % 2) {
                        for (size_t i = 0; i < len; i++)
                                buf[i] = (uint8_t) rand_r(&seed);
                        assert_int_equal(image_write(img, buf, len, off), (ssize_t) len);
                        memcpy(f->model + off, buf, len);
                } else {
                        assert_int_equal(image_read(img, buf, len, off), (ssize_t) len);
                        assert_memory_equal(buf, f->model + off, len);
                }
        }
        /* Reads and writes past the end are clipped. */
        assert_int_equal(image_read(img, buf, 100, IMAGE_BYTES - 10), 10);
        assert_int_equal(image_read(img, buf, 100, IMAGE_BYTES), 0);
        assert_int_equal(image_write(img, buf, 100, IMAGE_BYTES - 10), 10);
        memcpy(f->model + IMAGE_BYTES - 10, buf, 10);
        check_all(img, f->model);

        assert_int_equal(image_flush(img), 0);
        ImageStatus st;

        image_status(img, &st);
        assert_int_equal(st.dirty_chunks, 0);
        assert_true(st.records > 0);
        assert_int_equal(st.changed_chunks, st.records);
        image_free(img);

        /* A fresh image with an empty RAM cache reads everything back from the cache files. */
        img = open_image(f, 64 * CS);
        check_all(img, f->model);
        image_free(img);
}

static void test_zero_chunk_loses_record(void **state) {
        Fixture *f = *state;
        uint8_t data[CS];
        uint8_t tag[IMAGE_TAG_LEN];
        Image *img = open_image(f, 64 * CS);

        memset(data, 0xab, sizeof(data));
        assert_int_equal(image_write(img, data, CS, 5 * CS), CS);
        assert_int_equal(image_flush(img), 0);
        assert_int_equal(image_chunk_tag(img, 5, tag), 0);
        memset(data, 0, sizeof(data));
        assert_int_equal(image_write(img, data, CS, 5 * CS), CS);
        assert_int_equal(image_flush(img), 0);
        assert_int_equal(image_chunk_tag(img, 5, tag), -ENOENT);
        image_free(img);

        Keyring *k;
        KeyringRecord rec;

        assert_int_equal(keyring_open(f->keyring, &k), 0);
        assert_int_equal(keyring_get(k, 5, &rec), -ENOENT);
        keyring_free(k);
}

/* Writes every chunk whole, chunk i with the byte i + 1, in the image and the model. */
static void fill_chunks(Fixture *f, Image *img) {
        uint8_t data[CS];

        for (uint64_t i = 0; i < 21; i++) {
                memset(data, (int) i + 1, sizeof(data));
                assert_int_equal(image_write(img, data, i == 20 ? 1536 : CS, i * CS), i == 20 ? 1536 : CS);
                memset(f->model + i * CS, (int) i + 1, i == 20 ? 1536 : CS);
        }
}

static void test_ram_bound_and_uploads(void **state) {
        Fixture *f = *state;
        uint8_t (*tags)[IMAGE_TAG_LEN] = malloc(64 * IMAGE_TAG_LEN);
        uint8_t data[CS];
        size_t n = 0;
        ImageStatus st;
        Image *img = open_image(f, 8 * CS);

        fill_chunks(f, img);
        assert_int_equal(image_flush(img), 0);
        check_all(img, f->model);
        image_status(img, &st);
        assert_true(st.ram_bytes <= 8 * CS);
        assert_int_equal(st.pending_uploads, 21);

        assert_int_equal(image_uploads_next(img, tags, 64, &n), 0);
        assert_int_equal(n, 21);
        assert_int_equal(image_uploads_done(img, tags, 10), 0);
        /* Rewriting a chunk makes its old tag pointless to upload. */
        memset(data, 0x77, sizeof(data));
        assert_int_equal(image_write(img, data, CS, 0), CS);
        assert_int_equal(image_flush(img), 0);
        assert_int_equal(image_uploads_next(img, tags, 64, &n), 0);
        image_status(img, &st);
        assert_int_equal(st.pending_uploads, n);
        assert_true(n == 11 || n == 12);
        assert_int_equal(image_changed_reset(img), 0);
        image_status(img, &st);
        assert_int_equal(st.changed_chunks, 0);
        image_free(img);
        free(tags);
}

/* Chunk idx's object in the cache (flushed), for a test to delete. */
static void object_path(Fixture *f, Image *img, uint64_t idx, char *path, size_t size) {
        uint8_t tag[IMAGE_TAG_LEN];
        char hex[65];

        assert_int_equal(image_chunk_tag(img, idx, tag), 0);
        hex_encode(tag, IMAGE_TAG_LEN, hex);
        snprintf(path, size, "%s/chunks/%.2s/%.2s/%s", f->cache_dir, hex, hex + 2, hex);
}

/* Flushes img, closes it, deletes chunk idx's object from the cache and opens the image again. */
static Image *reopen_without(Fixture *f, Image *img, uint64_t idx) {
        char path[256];

        assert_int_equal(image_flush(img), 0);
        object_path(f, img, idx, path, sizeof(path));
        image_free(img);
        assert_int_equal(unlink(path), 0);
        return open_image(f, 64 * CS);
}

static void test_missing_everywhere_is_eio(void **state) {
        Fixture *f = *state;
        uint8_t data[CS];
        Image *img = open_image(f, 64 * CS);

        memset(data, 0x42, sizeof(data));
        assert_int_equal(image_write(img, data, CS, 2 * CS), CS);
        img = reopen_without(f, img, 2);
        log_set_max_level(LOG_EMERG);        /* the expected error line */
        assert_int_equal(image_read(img, data, 10, 2 * CS), -EIO);
        log_set_max_level(LOG_INFO);
        assert_int_equal(image_read(img, data, 10, 3 * CS), 10);       /* other chunks are fine */
        image_free(img);
}

static size_t put_be(uint8_t *p, uint64_t v, size_t n) {
        for (size_t i = 0; i < n; i++)
                p[i] = (uint8_t) (v >> (8 * (n - 1 - i)));
        return n;
}

/* A resume pack with two extents: [a, a + len) filled with fill_a and [b, b + len) with fill_b. */
static uint8_t *make_pack(uint64_t image_bytes, uint64_t a, uint8_t fill_a, uint64_t b, uint8_t fill_b, size_t len,
                          size_t *ret_len) {
        size_t total = PACK_HEADER_LEN + 2 * PACK_EXTENT_LEN + 2 * len, at = 0;
        uint8_t *p = malloc(total);

        memcpy(p, "ISRP\1\0\0\0", 8);
        at = 8;
        at += put_be(p + at, image_bytes, 8);
        at += put_be(p + at, 2, 8);
        at += put_be(p + at, a, 8);
        at += put_be(p + at, len, 4);
        at += put_be(p + at, b, 8);
        at += put_be(p + at, len, 4);
        memset(p + at, fill_a, len);
        memset(p + at + len, fill_b, len);
        *ret_len = total;
        return p;
}

static void test_resume_pack(void **state) {
        Fixture *f = *state;
        uint8_t data[CS], buf[CS], *pack;
        size_t pack_len;
        ImageStatus st;
        Image *img = open_image(f, 64 * CS);

        memset(data, 0x43, sizeof(data));
        assert_int_equal(image_write(img, data, CS, 3 * CS), CS);
        memset(data, 0x42, sizeof(data));
        assert_int_equal(image_write(img, data, CS, 2 * CS), CS);
        /* Chunk 2 is nowhere any more: only the pack can answer for it. */
        img = reopen_without(f, img, 2);
        /* A pack for another image size, or with a wrong magic, is refused and not kept. */
        pack = make_pack(IMAGE_BYTES + CS, 2 * CS + 100, 0x42, 3 * CS, 0x77, 800, &pack_len);
        log_set_max_level(LOG_EMERG);
        assert_int_equal(image_preload(img, pack, pack_len, 0), -EBADMSG);
        pack[0] = 'X';
        put_be(pack + 8, IMAGE_BYTES, 8);
        assert_int_equal(image_preload(img, pack, pack_len, 0), -EBADMSG);
        log_set_max_level(LOG_INFO);
        free(pack);

        /* Chunk 2's bytes as they are; chunk 3's made up, to show where a read is served from. */
        pack = make_pack(IMAGE_BYTES, 2 * CS + 100, 0x42, 3 * CS, 0x77, 800, &pack_len);
        assert_int_equal(image_preload(img, pack, pack_len, 0), 0);
        /* A second part may come later, overlapping the first (both hold the same version's bytes). */
        pack = make_pack(IMAGE_BYTES, 2 * CS + 500, 0x42, 5 * CS, 0x55, 1000, &pack_len);
        assert_int_equal(image_preload(img, pack, pack_len, 1), 0);
        /* Each part comes once. */
        pack = make_pack(IMAGE_BYTES, 2 * CS + 500, 0x42, 5 * CS, 0x55, 1000, &pack_len);
        assert_int_equal(image_preload(img, pack, pack_len, 1), -EBUSY);
        free(pack);
        image_status(img, &st);
        assert_int_equal(st.pack_bytes, 3600);

        assert_int_equal(image_read(img, buf, 700, 2 * CS + 150), 700);
        assert_memory_equal(buf, data, 700);
        assert_int_equal(image_read(img, buf, 1000, 2 * CS + 500), 1000);    /* only the second part has all */
        assert_memory_equal(buf, data, 1000);
        assert_int_equal(image_read(img, buf, 800, 3 * CS), 800);
        memset(data, 0x77, 800);
        assert_memory_equal(buf, data, 800);
        assert_int_equal(f->stats.hits[STATS_TIER_PACK], 3);
        /* A read the pack does not hold all of goes to the chunk, which exists nowhere. */
        log_set_max_level(LOG_EMERG);
        assert_int_equal(image_read(img, buf, 10, 2 * CS + 95), -EIO);
        log_set_max_level(LOG_INFO);
        /* A write makes the chunk's own content the truth again: the pack no longer answers for it. */
        buf[0] = 0x99;
        assert_int_equal(image_write(img, buf, 1, 3 * CS + 2000), 1);
        assert_int_equal(image_read(img, buf, 800, 3 * CS), 800);
        memset(data, 0x43, 800);
        assert_memory_equal(buf, data, 800);
        assert_int_equal(f->stats.hits[STATS_TIER_PACK], 3);
        image_free(img);
}

/* A version-2 pack: extents (each filled with its own byte) and a map of the parts to come. */
typedef struct TestExtent {
        uint64_t offset;
        uint32_t len, fill_or_part;
} TestExtent;

static uint8_t *make_pack_v2(const TestExtent *extents, size_t n, const TestExtent *map, size_t n_map,
                             size_t *ret_len) {
        size_t total = PACK_HEADER_V2_LEN + n * PACK_EXTENT_LEN + n_map * PACK_MAP_LEN, at;
        uint8_t *p;

        for (size_t i = 0; i < n; i++)
                total += extents[i].len;
        p = malloc(total);
        memcpy(p, "ISRP\2\0\0\0", 8);
        at = 8;
        at += put_be(p + at, IMAGE_BYTES, 8);
        at += put_be(p + at, n, 8);
        at += put_be(p + at, n_map, 8);
        for (size_t i = 0; i < n; i++) {
                at += put_be(p + at, extents[i].offset, 8);
                at += put_be(p + at, extents[i].len, 4);
        }
        for (size_t i = 0; i < n_map; i++) {
                at += put_be(p + at, map[i].offset, 8);
                at += put_be(p + at, map[i].len, 4);
                at += put_be(p + at, map[i].fill_or_part, 4);
        }
        for (size_t i = 0; i < n; i++) {
                memset(p + at, (int) extents[i].fill_or_part, extents[i].len);
                at += extents[i].len;
        }
        *ret_len = total;
        return p;
}

typedef struct PackReader {
        Image *img;
        uint64_t offset;
        uint8_t buf[100];
        ssize_t r;
} PackReader;

static void *pack_reader(void *userdata) {
        PackReader *pr = userdata;

        pr->r = image_read(pr->img, pr->buf, sizeof(pr->buf), pr->offset);
        return NULL;
}

static double seconds_since(const struct timespec *start) {
        struct timespec now;

        clock_gettime(CLOCK_MONOTONIC, &now);
        return (double) (now.tv_sec - start->tv_sec) + (double) (now.tv_nsec - start->tv_nsec) / 1e9;
}

/*
 * The map of a version-2 pack: a read of bytes in a part soon to come waits for it instead of fetching the
 * chunk (here the chunks exist nowhere, so a read that does not wait fails); one in a part further away, or
 * after the end, or once no part came for PACK_STALL_MS, does not wait.
 */
static void test_resume_pack_map_waits(void **state) {
        Fixture *f = *state;
        const TestExtent first[] = { { 10 * CS, 100, 0x11 } };
        const TestExtent map[] = { { 4 * CS, CS, 1 }, { 6 * CS, CS, 2 }, { 8 * CS, CS, 5 } };
        const TestExtent second[] = { { 4 * CS, CS, 0x44 } };
        uint8_t data[CS], *pack;
        size_t pack_len;
        ImageStatus st;
        PackReader pr;
        pthread_t reader;
        struct timespec start;
        Image *img = open_image(f, 64 * CS);

        for (uint64_t idx = 4; idx <= 8; idx += 2) {
                memset(data, (int) (0x40 + idx), sizeof(data));
                assert_int_equal(image_write(img, data, CS, idx * CS), CS);
        }
        for (uint64_t idx = 4; idx <= 8; idx += 2)
                img = reopen_without(f, img, idx);
        log_set_max_level(LOG_EMERG);        /* the expected error lines */
        pack = make_pack_v2(first, 1, map, 3, &pack_len);
        assert_int_equal(image_preload(img, pack, pack_len, 0), 0);

        /* Part 5 is too far ahead: the chunk is fetched (and fails) at once. */
        assert_int_equal(image_read(img, data, 10, 8 * CS), -EIO);
        /* Part 1 is next: the read waits for it and gets its bytes. */
        pr = (PackReader) { .img = img, .offset = 4 * CS + 20 };
        assert_int_equal(pthread_create(&reader, NULL, pack_reader, &pr), 0);
        usleep(100 * 1000);
        pack = make_pack_v2(second, 1, NULL, 0, &pack_len);
        assert_int_equal(image_preload(img, pack, pack_len, 1), 0);
        assert_int_equal(pthread_join(reader, NULL), 0);
        assert_int_equal(pr.r, 100);
        memset(data, 0x44, 100);
        assert_memory_equal(pr.buf, data, 100);
        image_status(img, &st);
        assert_true(st.pack_waits >= 1);
        assert_int_equal(st.pack_parts, 2);
        /* After the end, a read of part 2 (now next) does not wait. */
        image_preload_end(img, 0);
        assert_int_equal(image_read(img, data, 10, 6 * CS), -EIO);

        /* A pack whose parts stop coming: the read waits PACK_STALL_MS after the last part, then fetches. */
        image_free(img);
        img = open_image(f, 64 * CS);
        pack = make_pack_v2(first, 1, map, 3, &pack_len);
        clock_gettime(CLOCK_MONOTONIC, &start);
        assert_int_equal(image_preload(img, pack, pack_len, 0), 0);
        assert_int_equal(image_read(img, data, 10, 4 * CS), -EIO);
        assert_true(seconds_since(&start) >= 1.9);
        assert_int_equal(image_read(img, data, 10, 6 * CS), -EIO);     /* the pack has ended: no second wait */
        log_set_max_level(LOG_INFO);
        image_free(img);
}

static void test_punch(void **state) {
        Fixture *f = *state;
        uint8_t data[CS], tag[IMAGE_TAG_LEN];
        char path[256];
        ImageStatus st;
        Image *img = open_image(f, 64 * CS);

        fill_chunks(f, img);
        assert_int_equal(image_flush(img), 0);
        /* Chunk 4 is nowhere but its record: a punch that covers it whole must not read it. */
        object_path(f, img, 4, path, sizeof(path));
        assert_int_equal(unlink(path), 0);

        /* Chunk 2 from byte 100, chunks 3-5 whole, chunk 6 up to byte 50. */
        assert_int_equal(image_punch(img, 2 * CS + 100, 4 * CS - 50), 0);
        memset(f->model + 2 * CS + 100, 0, 4 * CS - 50);
        /* Within one chunk; across the edge of two with no whole chunk between; past the end (clipped),
         * taking the short last chunk whole. */
        assert_int_equal(image_punch(img, 8 * CS + 10, 20), 0);
        memset(f->model + 8 * CS + 10, 0, 20);
        assert_int_equal(image_punch(img, 10 * CS - 7, 17), 0);
        memset(f->model + 10 * CS - 7, 0, 17);
        assert_int_equal(image_punch(img, 20 * CS, 10 * CS), 0);
        memset(f->model + 20 * CS, 0, 1536);
        assert_int_equal(image_punch(img, IMAGE_BYTES, CS), 0);
        assert_int_equal(image_punch(img, 0, 0), 0);
        check_all(img, f->model);
        image_status(img, &st);
        assert_int_equal(st.records, 21);                  /* until the flush */
        assert_int_equal(image_flush(img), 0);
        image_status(img, &st);
        assert_int_equal(st.records, 21 - 4);
        for (uint64_t i = 3; i <= 5; i++)
                assert_int_equal(image_chunk_tag(img, i, tag), -ENOENT);
        assert_int_equal(image_chunk_tag(img, 20, tag), -ENOENT);
        assert_int_equal(image_chunk_tag(img, 2, tag), 0);
        assert_int_equal(image_chunk_tag(img, 6, tag), 0);
        /* A punched chunk written again is stored again. */
        memset(data, 0x5a, sizeof(data));
        assert_int_equal(image_write(img, data, 10, 5 * CS + 1), 10);
        memset(f->model + 5 * CS + 1, 0x5a, 10);
        assert_int_equal(image_flush(img), 0);
        assert_int_equal(image_chunk_tag(img, 5, tag), 0);
        image_free(img);

        /* Durable: a fresh image reads the holes as zeros without a record, and the rest from the cache. */
        img = open_image(f, 64 * CS);
        memset(&f->stats, 0, sizeof(f->stats));
        check_all(img, f->model);
        assert_int_equal(f->stats.hits[STATS_TIER_ZERO], 3);        /* chunks 3, 4 and 20 */
        assert_int_equal(f->stats.errors, 0);
        image_free(img);
}

/* A memory image (full_waits): chunks punched whole need no room, so they are not unreserved (the session
 * pauses the VM for those), and a write to one reserves like a write to a clean chunk. */
static void test_punch_needs_no_room(void **state) {
        Fixture *f = *state;
        uint8_t data[CS];
        ImageStatus st;
        Image *img = open_image(f, 64 * CS);

        image_set_full_waits(img, true);
        fill_chunks(f, img);
        assert_int_equal(image_flush(img), 0);
        assert_int_equal(image_punch(img, 3 * CS, 3 * CS), 0);
        image_status(img, &st);
        assert_int_equal(st.dirty_chunks, 3);
        assert_int_equal(st.unreserved_chunks, 0);
        memset(data, 0x77, sizeof(data));
        assert_int_equal(image_write(img, data, 10, 4 * CS + 1), 10);
        memset(f->model + 3 * CS, 0, 3 * CS);
        memset(f->model + 4 * CS + 1, 0x77, 10);
        image_status(img, &st);
        assert_int_equal(st.dirty_chunks, 3);
        assert_int_equal(st.unreserved_chunks, 0);
        check_all(img, f->model);
        assert_int_equal(image_flush(img), 0);
        image_status(img, &st);
        assert_int_equal(st.dirty_chunks, 0);
        assert_int_equal(st.records, 21 - 2);
        image_free(img);
}

static void test_trace_format(void **state) {
        char line[128];

        (void) state;
        trace_format(line, sizeof(line), 1700000000.123456, "memory", 42, TRACE_WRITE, STATS_TIER_LOOKASIDE,
                     42 * 131072 + 4096, 8192);
        assert_string_equal(line, "1700000000.123456 memory 42 w lookaside 5509120 8192");
        trace_format(line, sizeof(line), 1.0, "disk", 0, TRACE_READ, STATS_TIER_RAM, 0, 131072);
        assert_string_equal(line, "1.000000 disk 0 r ram 0 131072");
        assert_int_equal(stats_latency_bound(0), 500);
        assert_int_equal(stats_latency_bound(STATS_LATENCY_BUCKETS - 1), UINT64_MAX);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test_setup_teardown(test_read_modify_write_against_model, setup, teardown),
                cmocka_unit_test_setup_teardown(test_zero_chunk_loses_record, setup, teardown),
                cmocka_unit_test_setup_teardown(test_ram_bound_and_uploads, setup, teardown),
                cmocka_unit_test_setup_teardown(test_missing_everywhere_is_eio, setup, teardown),
                cmocka_unit_test_setup_teardown(test_resume_pack, setup, teardown),
                cmocka_unit_test_setup_teardown(test_resume_pack_map_waits, setup, teardown),
                cmocka_unit_test_setup_teardown(test_punch, setup, teardown),
                cmocka_unit_test_setup_teardown(test_punch_needs_no_room, setup, teardown),
                cmocka_unit_test(test_trace_format),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
