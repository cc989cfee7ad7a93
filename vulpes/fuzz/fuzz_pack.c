/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The resume pack's payload (pack.c).  Input: the image size (8 bytes, big-endian), then a payload as isr
 * hands it to vulpes.  An accepted pack's extents and map entries must be non-empty, in order, inside the
 * image, the map's parts in range, and the extents' bytes must exactly fill the payload after the tables.
 */
#include <errno.h>

#include "fuzz.h"
#include "pack.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        PackInfo info;
        const uint8_t *payload, *at;
        uint64_t image_size, end = 0;
        size_t len;
        int r;

        if (size < 8)
                return 0;
        payload = data + 8;
        len = size - 8;
        image_size = fuzz_be(data, 8);
        r = pack_parse(payload, len, image_size, &info);
        FUZZ_CHECK(r == 0 || r == -EBADMSG, "pack_parse returned neither 0 nor -EBADMSG");
        if (r < 0)
                return 0;
        at = payload + (payload[4] == 1 ? PACK_HEADER_LEN : PACK_HEADER_V2_LEN) + info.n * PACK_EXTENT_LEN +
             info.n_map * PACK_MAP_LEN;
        for (size_t i = 0; i < info.n; i++) {
                const PackExtent *e = &info.extents[i];

                FUZZ_CHECK(e->len > 0, "an empty extent");
                FUZZ_CHECK(e->offset >= end, "extents out of order or overlapping");
                FUZZ_CHECK(e->offset <= image_size && e->len <= image_size - e->offset, "an extent beyond the image");
                FUZZ_CHECK(e->data == at, "an extent's bytes are not where the format puts them");
                end = e->offset + e->len;
                at += e->len;
        }
        FUZZ_CHECK(at == payload + len, "the extents do not fill the payload");
        end = 0;
        for (size_t i = 0; i < info.n_map; i++) {
                const PackMapEntry *m = &info.map[i];

                FUZZ_CHECK(m->len > 0 && m->offset >= end, "map entries empty, out of order or overlapping");
                FUZZ_CHECK(m->offset <= image_size && m->len <= image_size - m->offset, "a map entry beyond the image");
                FUZZ_CHECK(m->part >= 1 && m->part < PACK_PARTS_MAX, "a map entry names a part out of range");
                FUZZ_CHECK(pack_map_find(info.map, info.n_map, m->offset) == m, "a map entry is not found at its start");
                end = m->offset + m->len;
        }
        pack_info_free(&info);
        return 0;
}
