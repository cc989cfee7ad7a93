/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include "daemon.h"

typedef struct Control Control;

/*
 * Listens on a Unix socket at path (replacing a stale one) for isrctl: one JSON object per line in each
 * direction.  Requests and responses are documented in doc/vulpes.md.
 */
int control_start(Daemon *d, const char *path, Control **ret);

/*
 * The answer to one request line, as a connection gives it: a JSON object, malloc()ed, without the newline
 * (NULL if out of memory).  The connections call it, and so does the fuzz harness (vulpes/fuzz/).
 */
char *control_answer(Control *c, const char *line, size_t len);

/* Stops listening and waits for running requests to finish. */
Control *control_stop(Control *c);
