/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

/*
 * The resume pack (doc/parcel-format.md, "Resume pack"): plaintext extents of a version's memory image that
 * the guest touched first after its last resume, which vulpes serves before any chunk of them arrives.
 * The payload is what a sealed kind-3 blob named "resumepack" (part 0) or "resumepack.N" holds; isr opens it
 * and hands it to vulpes in RAM (a memfd), never on disk.  A version-2 payload also carries a map: which later
 * part holds which bytes, so that a read of bytes still on their way can wait for them instead of fetching
 * their chunk.
 */
#define PACK_HEADER_LEN 24              /* version 1 */
#define PACK_HEADER_V2_LEN 32           /* version 2: the map's entry count follows the extent count */
#define PACK_EXTENT_LEN 12
#define PACK_MAP_LEN 16
#define PACK_PARTS_MAX 256              /* parts a pack has at most, so the highest index a map may name + 1 */

typedef struct PackExtent {
        uint64_t offset;
        uint32_t len;
        const uint8_t *data;           /* points into the payload */
} PackExtent;

/* [offset, offset + len) of the image is in part `part` (1 .. PACK_PARTS_MAX - 1). */
typedef struct PackMapEntry {
        uint64_t offset;
        uint32_t len;
        uint32_t part;
} PackMapEntry;

typedef struct PackInfo {
        PackExtent *extents;           /* malloc()ed, in increasing order */
        size_t n;
        PackMapEntry *map;             /* malloc()ed, in increasing order; NULL for a version-1 payload */
        size_t n_map;
} PackInfo;

/*
 * Checks a payload against the format and an image of image_size bytes and lists its extents and its map
 * (they point into payload, which must outlive them; free them with pack_info_free()).  -EBADMSG, after one
 * log line saying what is wrong, if the magic, version, reserved bytes, image size, order, bounds, part
 * numbers or total length are not as the format requires; -ENOMEM.
 */
int pack_parse(const uint8_t *payload, size_t len, uint64_t image_size, PackInfo *ret);
void pack_info_free(PackInfo *info);

/* The map entry holding byte pos, or NULL. */
const PackMapEntry *pack_map_find(const PackMapEntry *map, size_t n, uint64_t pos);
