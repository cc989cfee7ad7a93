/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <syslog.h>

/* Levels are syslog's: LOG_ERR, LOG_WARNING, LOG_NOTICE, LOG_INFO, LOG_DEBUG. */
void log_set_max_level(int level);
void log_set_ident(const char *ident);

/* "error", "warning", "info" or "debug" (the programs' --log-level) as a level; -1 for anything else. */
int log_level_parse(const char *name);

void log_msg(int level, const char *format, ...) __attribute__((format(printf, 2, 3)));

/* Whether messages of this level are printed (to skip work that only feeds them). */
bool log_enabled(int level);

#define log_error(...) log_msg(LOG_ERR, __VA_ARGS__)
#define log_warning(...) log_msg(LOG_WARNING, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_DEBUG, __VA_ARGS__)
