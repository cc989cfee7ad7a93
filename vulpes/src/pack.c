/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The resume pack's payload, all integers big-endian: a header (magic "ISRP", the version, 3 reserved zero
 * bytes, the image size, the extent count; version 2 adds the map's entry count), the extents (offset u64,
 * length u32) in strictly increasing, non-overlapping order, in version 2 the map (offset u64, length u32,
 * part u32, in the same order), then the extents' bytes, concatenated in the extents' order.
 */
#include "pack.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static uint64_t get_be(const uint8_t *p, size_t n) {
        uint64_t v = 0;

        for (size_t i = 0; i < n; i++)
                v = v << 8 | p[i];
        return v;
}

#define REJECT(...) do { log_error("resume pack rejected: " __VA_ARGS__); r = -EBADMSG; goto fail; } while (0)

static bool outside(uint64_t offset, uint64_t length, uint64_t end, uint64_t image_size) {
        return length == 0 || offset < end || offset > image_size || length > image_size - offset;
}

int pack_parse(const uint8_t *payload, size_t len, uint64_t image_size, PackInfo *ret) {
        PackInfo info = { 0 };
        uint64_t n, n_map = 0, data_len = 0, end = 0, header;
        const uint8_t *data, *map;
        int r;

        if (len < PACK_HEADER_LEN)
                REJECT("%zu bytes is shorter than its header", len);
        if (memcmp(payload, "ISRP", 4) != 0 || (payload[4] != 1 && payload[4] != 2) || payload[5] || payload[6] ||
            payload[7])
                REJECT("wrong magic, version or reserved bytes");
        header = payload[4] == 1 ? PACK_HEADER_LEN : PACK_HEADER_V2_LEN;
        if (len < header)
                REJECT("%zu bytes is shorter than its header", len);
        if (get_be(payload + 8, 8) != image_size)
                REJECT("it is for an image of %llu bytes, not %llu",
                       (unsigned long long) get_be(payload + 8, 8), (unsigned long long) image_size);
        n = get_be(payload + 16, 8);
        if (header == PACK_HEADER_V2_LEN)
                n_map = get_be(payload + 24, 8);
        if (n > (len - header) / PACK_EXTENT_LEN ||
            n_map > (len - header - n * PACK_EXTENT_LEN) / PACK_MAP_LEN)
                REJECT("%llu extents and %llu map entries do not fit in %zu bytes", (unsigned long long) n,
                       (unsigned long long) n_map, len);
        info.extents = calloc(n ? n : 1, sizeof(*info.extents));
        if (!info.extents)
                return -ENOMEM;
        if (n_map) {
                info.map = calloc(n_map, sizeof(*info.map));
                if (!info.map) {
                        free(info.extents);
                        return -ENOMEM;
                }
        }
        map = payload + header + n * PACK_EXTENT_LEN;
        data = map + n_map * PACK_MAP_LEN;
        for (uint64_t i = 0; i < n; i++) {
                const uint8_t *e = payload + header + i * PACK_EXTENT_LEN;
                uint64_t offset = get_be(e, 8), length = get_be(e + 8, 4);

                if (outside(offset, length, end, image_size))
                        REJECT("extent %llu (%llu+%llu) is empty, out of order, overlapping or beyond the image",
                               (unsigned long long) i, (unsigned long long) offset, (unsigned long long) length);
                info.extents[i] = (PackExtent) { .offset = offset, .len = (uint32_t) length, .data = data + data_len };
                data_len += length;
                end = offset + length;
        }
        end = 0;
        for (uint64_t i = 0; i < n_map; i++) {
                const uint8_t *e = map + i * PACK_MAP_LEN;
                uint64_t offset = get_be(e, 8), length = get_be(e + 8, 4), part = get_be(e + 12, 4);

                if (outside(offset, length, end, image_size))
                        REJECT("map entry %llu (%llu+%llu) is empty, out of order, overlapping or beyond the image",
                               (unsigned long long) i, (unsigned long long) offset, (unsigned long long) length);
                if (part == 0 || part >= PACK_PARTS_MAX)
                        REJECT("map entry %llu names part %llu (1 to %d)", (unsigned long long) i,
                               (unsigned long long) part, PACK_PARTS_MAX - 1);
                info.map[i] = (PackMapEntry) { .offset = offset, .len = (uint32_t) length, .part = (uint32_t) part };
                end = offset + length;
        }
        if ((size_t) (data - payload) + data_len != len)
                REJECT("its extents hold %llu bytes but %zu follow them", (unsigned long long) data_len,
                       len - (size_t) (data - payload));
        info.n = (size_t) n;
        info.n_map = (size_t) n_map;
        *ret = info;
        return 0;
fail:
        pack_info_free(&info);
        return r;
}

void pack_info_free(PackInfo *info) {
        free(info->extents);
        free(info->map);
        *info = (PackInfo) { 0 };
}

const PackMapEntry *pack_map_find(const PackMapEntry *map, size_t n, uint64_t pos) {
        size_t lo = 0, hi = n;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;

                if (map[mid].offset <= pos)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        if (lo == 0)
                return NULL;
        return pos < map[lo - 1].offset + map[lo - 1].len ? &map[lo - 1] : NULL;
}
