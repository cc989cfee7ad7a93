/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * One-line diagnostics on stderr, filtered by a process-wide maximum level.
 *
 * Library modules log where an error is decided.  Rejecting bad input (a damaged chunk object, a wrong
 * passphrase) is an expected outcome whose policy belongs to the caller, so those are logged at LOG_DEBUG;
 * environment failures (database I/O, OpenSSL internals) are logged at LOG_ERR.
 *
 * Threading: safe from any thread; each message is formatted first and written with one stdio call, so
 * lines from different threads do not interleave.
 */
#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

static atomic_int max_level = LOG_INFO;
static const char *log_ident = "vulpes";

void log_set_max_level(int level) {
        atomic_store(&max_level, level);
}

/* Not thread-safe: call once at start-up, before other threads exist. */
void log_set_ident(const char *ident) {
        log_ident = ident;
}

bool log_enabled(int level) {
        return level <= atomic_load(&max_level);
}

int log_level_parse(const char *name) {
        static const struct {
                const char *name;
                int level;
        } levels[] = { { "error", LOG_ERR }, { "warning", LOG_WARNING }, { "info", LOG_INFO }, { "debug", LOG_DEBUG } };

        for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++)
                if (strcmp(name, levels[i].name) == 0)
                        return levels[i].level;
        return -1;
}

void log_msg(int level, const char *format, ...) {
        char line[1024];
        va_list ap;

        if (level > atomic_load(&max_level))
                return;

        va_start(ap, format);
        vsnprintf(line, sizeof(line), format, ap);
        va_end(ap);

        fprintf(stderr, "%s: %s\n", log_ident, line);
}
