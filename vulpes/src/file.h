/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

/* Reads a whole regular file of at most max_len bytes into a malloc()ed buffer (with a NUL after it). */
int file_read_all(const char *path, size_t max_len, uint8_t **ret_data, size_t *ret_len);

/* Write all of data to fd, retrying short writes and EINTR; -errno on failure. */
int file_write_full(int fd, const void *data, size_t len);

/* fsync()s the file or directory at path (relative to dir_fd, or AT_FDCWD): the one "sync this path"
 * helper of the C code.  0 or -errno. */
int file_sync_at(int dir_fd, const char *path);

/* Writes a file as the format requires: temporary file in the same directory, fsync, rename, fsync of
 * the directory.  mode is that of the new file. */
int file_write_atomic(const char *path, const void *data, size_t len, unsigned mode);
