/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Whole-file reads and crash-safe whole-file writes (temporary file, fsync, rename, fsync directory).
 *
 * Threading: safe from any thread; temporary names are unique per call (mkstemp).
 */
#define _GNU_SOURCE
#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

int file_read_all(const char *path, size_t max_len, uint8_t **ret_data, size_t *ret_len) {
        struct stat st;
        uint8_t *data = NULL;
        size_t len = 0;
        int fd, r = 0;

        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
                r = -errno;
                log_error("failed to open %s: %s", path, strerror(-r));
                return r;
        }
        if (fstat(fd, &st) < 0) {
                r = -errno;
                log_error("failed to stat %s: %s", path, strerror(-r));
                goto out_close;
        }
        if (!S_ISREG(st.st_mode) || (uint64_t) st.st_size > max_len) {
                r = S_ISREG(st.st_mode) ? -EFBIG : -EINVAL;
                log_error("failed to read %s: %s", path, strerror(-r));
                goto out_close;
        }
        data = malloc((size_t) st.st_size + 1);
        if (!data) {
                r = -ENOMEM;
                goto out_close;
        }
        while (len < (size_t) st.st_size) {
                ssize_t n = read(fd, data + len, (size_t) st.st_size - len);

                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0) {
                        r = n < 0 ? -errno : -EIO;
                        log_error("failed to read %s: %s", path, strerror(-r));
                        goto out_data;
                }
                len += (size_t) n;
        }
        data[len] = 0;
        *ret_data = data;
        *ret_len = len;
        goto out_close;

out_data:
        free(data);
out_close:
        close(fd);
        return r;
}

int file_write_full(int fd, const void *data, size_t len) {
        const uint8_t *p = data;

        while (len > 0) {
                ssize_t n = write(fd, p, len);

                if (n < 0 && errno == EINTR)
                        continue;
                if (n < 0)
                        return -errno;
                p += n;
                len -= (size_t) n;
        }
        return 0;
}

int file_sync_at(int dir_fd, const char *path) {
        int fd, r = 0;

        fd = openat(dir_fd, path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return -errno;
        if (fsync(fd) < 0)
                r = -errno;
        close(fd);
        return r;
}

int file_write_atomic(const char *path, const void *data, size_t len, unsigned mode) {
        char *tmp = NULL, *dir_copy = NULL;
        int fd = -1, r = 0;

        if (asprintf(&tmp, "%s.tmp-XXXXXX", path) < 0)
                return -ENOMEM;
        fd = mkostemp(tmp, O_CLOEXEC);
        if (fd < 0) {
                r = -errno;
                log_error("failed to create %s: %s", tmp, strerror(-r));
                goto out_free;
        }
        if (fchmod(fd, mode) < 0 || (r = file_write_full(fd, data, len)) < 0 || fsync(fd) < 0) {
                r = r < 0 ? r : -errno;
                log_error("failed to write %s: %s", tmp, strerror(-r));
                goto out_unlink;
        }
        r = 0;
        if (close(fd) < 0) {
                fd = -1;
                r = -errno;
                log_error("failed to write %s: %s", tmp, strerror(-r));
                goto out_unlink;
        }
        fd = -1;
        if (rename(tmp, path) < 0) {
                r = -errno;
                log_error("failed to rename %s to %s: %s", tmp, path, strerror(-r));
                goto out_unlink;
        }

        dir_copy = strdup(path);
        if (!dir_copy) {
                r = -ENOMEM;
                goto out_free;
        }
        r = file_sync_at(AT_FDCWD, dirname(dir_copy));
        if (r < 0)
                log_error("failed to sync directory of %s: %s", path, strerror(-r));
        goto out_free;

out_unlink:
        if (fd >= 0)
                close(fd);
        unlink(tmp);
out_free:
        free(dir_copy);
        free(tmp);
        return r;
}
