/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

/*
 * The resume pack (doc/parcel-format.md, "Resume pack"): plaintext extents of a version's memory image that
 * the guest touched first after its last resume, which vulpes serves before any chunk of them arrives.
 * The payload is what a sealed kind-3 blob named "resumepack" holds; isr opens it and hands it to vulpes
 * in RAM (a memfd), never on disk.
 */
#define PACK_HEADER_LEN 24
#define PACK_EXTENT_LEN 12

typedef struct PackExtent {
        uint64_t offset;
        uint32_t len;
        const uint8_t *data;           /* points into the payload */
} PackExtent;

/*
 * Checks a payload against the format and an image of image_size bytes and lists its extents (malloc()ed;
 * they point into payload, which must outlive them).  -EBADMSG, after one log line saying what is wrong,
 * if the magic, version, reserved bytes, image size, order, bounds or total length are not as the format
 * requires.
 */
int pack_parse(const uint8_t *payload, size_t len, uint64_t image_size, PackExtent **ret_extents, size_t *ret_n);
