/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The resume pack's payload (pack.c).  Input: the image size (8 bytes, big-endian), then a payload as isr
 * hands it to vulpes.  An accepted pack's extents must be non-empty, in order, inside the image, and their
 * bytes must exactly fill the payload after the extent table.
 */
#include <errno.h>

#include "fuzz.h"
#include "pack.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        PackExtent *extents = NULL;
        const uint8_t *payload, *at;
        uint64_t image_size, end = 0;
        size_t len, n = 0;
        int r;

        if (size < 8)
                return 0;
        payload = data + 8;
        len = size - 8;
        image_size = fuzz_be(data, 8);
        r = pack_parse(payload, len, image_size, &extents, &n);
        FUZZ_CHECK(r == 0 || r == -EBADMSG, "pack_parse returned neither 0 nor -EBADMSG");
        if (r < 0)
                return 0;
        at = payload + PACK_HEADER_LEN + n * PACK_EXTENT_LEN;
        for (size_t i = 0; i < n; i++) {
                FUZZ_CHECK(extents[i].len > 0, "an empty extent");
                FUZZ_CHECK(extents[i].offset >= end, "extents out of order or overlapping");
                FUZZ_CHECK(extents[i].offset <= image_size && extents[i].len <= image_size - extents[i].offset,
                           "an extent beyond the image");
                FUZZ_CHECK(extents[i].data == at, "an extent's bytes are not where the format puts them");
                end = extents[i].offset + extents[i].len;
                at += extents[i].len;
        }
        FUZZ_CHECK(at == payload + len, "the extents do not fill the payload");
        free(extents);
        return 0;
}
