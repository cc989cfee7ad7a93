/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

/* Writes 2·len lowercase hex digits and a NUL to ret_str (2·len + 1 bytes). */
void hex_encode(const void *data, size_t len, char *ret_str);

/* Decodes str_len hex digits (either case) into a malloc()ed buffer; -EINVAL if not hex. */
int hex_decode(const char *str, size_t str_len, uint8_t **ret_data, size_t *ret_len);

/* Decodes a NUL-terminated hex string that must encode exactly len bytes. */
int hex_decode_exact(const char *str, void *ret_data, size_t len);
