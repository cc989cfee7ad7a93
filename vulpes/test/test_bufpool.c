/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Tests for bufpool.c: buffers are page-aligned, distinct and writable across several slabs; a returned
 * buffer is handed out again before any new memory; odd sizes round up to whole pages.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "bufpool.h"

#define N_BUFS 80       /* 10 MiB of 128 KiB buffers: three slabs */

static void test_buffers_distinct_aligned_reused(void **state) {
        size_t page = (size_t) sysconf(_SC_PAGESIZE), size = 128 << 10;
        uint8_t *bufs[N_BUFS], *again;
        BufPool *p = NULL;

        (void) state;
        assert_int_equal(bufpool_new(size, &p), 0);
        assert_int_equal(bufpool_buf_size(p), size);
        for (int i = 0; i < N_BUFS; i++) {
                bufs[i] = bufpool_get(p);
                assert_non_null(bufs[i]);
                assert_int_equal((uintptr_t) bufs[i] % page, 0);
                memset(bufs[i], i, size);
        }
        /* No two overlap: each still holds its own pattern. */
        for (int i = 0; i < N_BUFS; i++)
                for (size_t j = 0; j < size; j += page)
                        assert_int_equal(bufs[i][j], (uint8_t) i);
        bufpool_put(p, bufs[17]);
        again = bufpool_get(p);
        assert_ptr_equal(again, bufs[17]);
        for (int i = 0; i < N_BUFS; i++)
                bufpool_put(p, bufs[i]);
        bufpool_free(p);

        assert_int_equal(bufpool_new(5000, &p), 0);
        assert_int_equal(bufpool_buf_size(p) % page, 0);
        assert_true(bufpool_buf_size(p) >= 5000);
        bufpool_free(p);
        assert_int_equal(bufpool_new(0, &p), -EINVAL);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_buffers_distinct_aligned_reused),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
