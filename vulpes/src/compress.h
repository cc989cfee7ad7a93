/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>

#define COMPRESS_LEVEL_DEFAULT 3

/* The largest output compress_frame() can produce for len input bytes. */
size_t compress_bound(size_t len);

/*
 * Compresses in[0..len) into one zstd frame with the content size in its header, no checksum and no
 * dictionary.  Returns -ENOBUFS if the frame does not fit in out_capacity bytes.
 */
int compress_frame(const void *in, size_t len, int level, void *ret_out, size_t out_capacity, size_t *ret_len);

/*
 * Decompresses in[0..len), which must be exactly one complete zstd frame (no skippable frame, no
 * trailing bytes), into exactly expected_len bytes at ret_out.  Returns -EBADMSG if the frame is damaged
 * or would produce more or fewer bytes; ret_out[] then holds zeros.
 */
int compress_decompress_exact(const void *in, size_t len, void *ret_out, size_t expected_len);
