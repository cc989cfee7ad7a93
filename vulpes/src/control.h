/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include "daemon.h"

typedef struct Control Control;

/*
 * Listens on a Unix socket at path (replacing a stale one) for isrctl: one JSON object per line in each
 * direction.  Requests and responses are documented in doc/vulpes.md.
 */
int control_start(Daemon *d, const char *path, Control **ret);

/* Stops listening and waits for running requests to finish. */
Control *control_stop(Control *c);
