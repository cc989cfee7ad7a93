/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon.h"
#include "image.h"

/*
 * The warmer: fills the kernel's page cache of the memory mount's `memory` file with the chunks that are here,
 * ahead of the guest, so that its first touch of a page is a minor fault instead of a FUSE read (warm.c).
 */
typedef struct Warmer Warmer;

/* A warmer of img, whose file is `path` (the memory mount's `memory`); it starts once img has traced
 * `after_reads` reads (the guest's first page faults, which the trace must see: isrctl/pack.py). */
int warm_new(Image *img, const char *path, uint64_t after_reads, Warmer **ret);
/* Starts its thread. */
int warm_start(Warmer *w);
/* Whether a FUSE request came from the warmer (the requesting thread's id, fuse_req_ctx()->pid); false for a
 * NULL warmer. */
bool warm_is_own(Warmer *w, pid_t tid);
/* mount.c has answered one of the warmer's requests. */
void warm_served(Warmer *w);
/* A DaemonInvalidator: before the kernel's pages of the memory image are dropped, the warmer stops for good
 * (what the guest touches after that must reach the trace); returns once no request of it can start. */
int warm_invalidator(void *warmer, DaemonImage id);
/* A DaemonMappedTracer: traces, with source `mapped`, each page of a warmed chunk that process `pid` has
 * mapped from the memory file (its page tables, /proc/PID/pagemap): pages the guest touched without a FUSE
 * read.  Returns the number of pages traced or a negative errno. */
int warm_trace_mapped(void *warmer, pid_t pid);
/* Stops for good, joins the thread and closes the file (which would keep the memory mount busy); the other
 * calls stay safe.  NULL is fine. */
void warm_close(Warmer *w);
/* warm_close(), then frees: once nothing can call it any more (the control thread has stopped). */
Warmer *warm_free(Warmer *w);
