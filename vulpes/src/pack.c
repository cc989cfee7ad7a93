/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The resume pack's payload: a header (magic "ISRP", version 1, 3 reserved zero bytes, the image size, the
 * extent count, all big-endian), the extents (offset u64, length u32) in strictly increasing, non-overlapping
 * order, then their bytes, concatenated in the same order.
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

int pack_parse(const uint8_t *payload, size_t len, uint64_t image_size, PackExtent **ret_extents, size_t *ret_n) {
        PackExtent *extents = NULL;
        uint64_t n, data_len = 0, end = 0;
        const uint8_t *data;
        int r;

        if (len < PACK_HEADER_LEN)
                REJECT("%zu bytes is shorter than its header", len);
        if (memcmp(payload, "ISRP", 4) != 0 || payload[4] != 1 || payload[5] || payload[6] || payload[7])
                REJECT("wrong magic, version or reserved bytes");
        if (get_be(payload + 8, 8) != image_size)
                REJECT("it is for an image of %llu bytes, not %llu",
                       (unsigned long long) get_be(payload + 8, 8), (unsigned long long) image_size);
        n = get_be(payload + 16, 8);
        if (n > (len - PACK_HEADER_LEN) / PACK_EXTENT_LEN)
                REJECT("%llu extents do not fit in %zu bytes", (unsigned long long) n, len);
        extents = calloc(n ? n : 1, sizeof(*extents));
        if (!extents)
                return -ENOMEM;
        data = payload + PACK_HEADER_LEN + n * PACK_EXTENT_LEN;
        for (uint64_t i = 0; i < n; i++) {
                const uint8_t *e = payload + PACK_HEADER_LEN + i * PACK_EXTENT_LEN;
                uint64_t offset = get_be(e, 8), length = get_be(e + 8, 4);

                if (length == 0 || offset < end || offset > image_size || length > image_size - offset)
                        REJECT("extent %llu (%llu+%llu) is empty, out of order, overlapping or beyond the image",
                               (unsigned long long) i, (unsigned long long) offset, (unsigned long long) length);
                extents[i] = (PackExtent) { .offset = offset, .len = (uint32_t) length, .data = data + data_len };
                data_len += length;
                end = offset + length;
        }
        if ((size_t) (data - payload) + data_len != len)
                REJECT("its extents hold %llu bytes but %zu follow them", (unsigned long long) data_len,
                       len - (size_t) (data - payload));
        *ret_extents = extents;
        *ret_n = (size_t) n;
        return 0;
fail:
        free(extents);
        return r;
}
