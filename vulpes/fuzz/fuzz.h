/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * What the libFuzzer harnesses in this folder share: the fixed keys they seal and open with, a check that
 * aborts (libFuzzer saves the input that broke a property as a crash), and quiet logs.  Built by
 * `python -m tools.fuzz build` with clang -fsanitize=fuzzer,address,undefined; never part of the gcc build.
 */
#pragma once

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>

#include "log.h"

/* The parcel key and convergence secret every harness uses: fixed, so that inputs are reproducible. */
static const uint8_t fuzz_key[32] = {
        0x46, 0x55, 0x5a, 0x5a, 0x2d, 0x6b, 0x65, 0x79, 0x2d, 0x30, 0x31, 0x32, 0x33, 0x34, 0x35, 0x36,
        0x37, 0x38, 0x39, 0x61, 0x62, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, 0x69, 0x6a, 0x6b, 0x6c, 0x6d,
};

/* A property of the code under test does not hold: report it and abort, so libFuzzer keeps the input. */
#define FUZZ_CHECK(cond, what)                                                                 \
        do {                                                                                   \
                if (!(cond)) {                                                                 \
                        fprintf(stderr, "fuzz property violated at %s:%d: %s\n", __FILE__, __LINE__, what); \
                        abort();                                                               \
                }                                                                              \
        } while (0)

/* Rejecting bad input is logged at LOG_DEBUG (or LOG_ERR for pack.c): none of it is worth printing here. */
static inline void fuzz_quiet_logs(void) {
        log_set_max_level(getenv("FUZZ_LOGS") ? LOG_DEBUG : -1);
}

#ifndef FUZZ_OWN_INITIALIZE
/* A harness that needs no set-up of its own (one that does defines FUZZ_OWN_INITIALIZE and quiets the logs). */
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
        (void) argc;
        (void) argv;
        fuzz_quiet_logs();
        return 0;
}
#endif

static inline uint64_t fuzz_be(const uint8_t *p, size_t n) {
        uint64_t v = 0;

        for (size_t i = 0; i < n; i++)
                v = v << 8 | p[i];
        return v;
}

static inline void fuzz_put_be(uint8_t *p, uint64_t v, size_t n) {
        for (size_t i = n; i > 0; i--, v >>= 8)
                p[i - 1] = (uint8_t) v;
}
