/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * packload.c's stop rule.  The loading itself (fetch, open, check, preload, a damaged part, a stop) is tested
 * end to end against a real server: tests/test_pack.py.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "packload.h"

static void test_stops_only_past_keep_where_the_rest_would_take_too_long(void **state) {
        (void) state;
        /* 1 MB of payload opened in 1 s: 1 MB/s. */
        assert_false(packload_should_stop(7 << 20, 8 << 20, 10000000, 1000000, 1000000, 1.5));   /* below keep */
        assert_true(packload_should_stop(8 << 20, 8 << 20, 2000000, 1000000, 1000000, 1.5));     /* 2 s > 1.5 s */
        assert_false(packload_should_stop(8 << 20, 8 << 20, 1400000, 1000000, 1000000, 1.5));    /* 1.4 s */
        assert_false(packload_should_stop(8 << 20, 8 << 20, 0, 1000000, 1000000, 0));            /* nothing left */
        assert_false(packload_should_stop(UINT64_MAX - 1, PACKLOAD_KEEP_ALL, 1, 1, 1000000, 0)); /* keep all */
        /* No time has passed: the pace is taken over a millisecond at least, never divided by zero. */
        assert_true(packload_should_stop(1, 0, 2000, 1, 0, 1.0));
        assert_false(packload_should_stop(1, 0, 999, 1, 0, 1.0));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_stops_only_past_keep_where_the_rest_would_take_too_long),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
