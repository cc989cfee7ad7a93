/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Hex encoding: chunk tags as file names, digests in manifests, binary values in tools and test vectors.
 *
 * Threading: pure functions, safe from any thread.
 */
#include "hex.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int hex_digit(char c) {
        if (c >= '0' && c <= '9')
                return c - '0';
        if (c >= 'a' && c <= 'f')
                return c - 'a' + 10;
        if (c >= 'A' && c <= 'F')
                return c - 'A' + 10;
        return -1;
}

void hex_encode(const void *data, size_t len, char *ret_str) {
        static const char digits[] = "0123456789abcdef";
        const uint8_t *p = data;

        for (size_t i = 0; i < len; i++) {
                ret_str[2 * i] = digits[p[i] >> 4];
                ret_str[2 * i + 1] = digits[p[i] & 0xf];
        }
        ret_str[2 * len] = 0;
}

static int decode_into(const char *str, size_t str_len, uint8_t *out) {
        for (size_t i = 0; i < str_len / 2; i++) {
                int hi = hex_digit(str[2 * i]), lo = hex_digit(str[2 * i + 1]);

                if (hi < 0 || lo < 0)
                        return -EINVAL;
                out[i] = (uint8_t) (hi << 4 | lo);
        }
        return 0;
}

int hex_decode(const char *str, size_t str_len, uint8_t **ret_data, size_t *ret_len) {
        uint8_t *data;

        if (str_len % 2 != 0)
                return -EINVAL;
        data = malloc(str_len / 2 + 1);
        if (!data)
                return -ENOMEM;
        if (decode_into(str, str_len, data) < 0) {
                free(data);
                return -EINVAL;
        }
        *ret_data = data;
        *ret_len = str_len / 2;
        return 0;
}

int hex_decode_exact(const char *str, void *ret_data, size_t len) {
        if (strlen(str) != 2 * len)
                return -EINVAL;
        return decode_into(str, 2 * len, ret_data);
}
