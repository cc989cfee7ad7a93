/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The file system: three files at the mountpoint, `disk` and `memory` (the images, read-write) and
 * `stats` (the status report, read-only).  The only file that includes libfuse.
 *
 * The images use the page cache (no direct_io), so QEMU can map `memory` MAP_SHARED and the kernel
 * writes dirty pages back as ordinary FUSE writes; keep_cache keeps pages across opens, since nobody
 * but this daemon changes the images.  fsync (and flush, on close) makes everything acknowledged before
 * it durable (image_flush()).  `stats` is direct_io: each open takes a fresh snapshot.
 *
 * Threading: libfuse's multithreaded loop calls these operations concurrently; image.c does the locking.
 */
#define FUSE_USE_VERSION 314
#define _GNU_SOURCE
#include "mount.h"

#include <errno.h>
#include <fuse.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/statvfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

enum {
        FILE_DISK = DAEMON_IMAGE_DISK,
        FILE_MEMORY = DAEMON_IMAGE_MEMORY,
        FILE_STATS,
        _FILE_MAX,
};

static const char *const file_names[_FILE_MAX] = { "disk", "memory", "stats" };

struct Mount {
        Daemon *daemon;
        struct fuse *fuse;
        struct fuse_args args;
        char *mountpoint;
        bool mounted;
        unsigned max_threads;
};

typedef struct StatsSnapshot {
        char *text;
        size_t len;
} StatsSnapshot;

static Daemon *current_daemon(void) {
        return ((Mount *) fuse_get_context()->private_data)->daemon;
}

static int file_of(const char *path) {
        if (path[0] != '/')
                return -ENOENT;
        for (int i = 0; i < _FILE_MAX; i++)
                if (strcmp(path + 1, file_names[i]) == 0)
                        return i;
        return -ENOENT;
}

static void *op_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
        /* Sizes and names never change behind the kernel's back. */
        cfg->entry_timeout = 3600;
        cfg->attr_timeout = 3600;
        cfg->negative_timeout = 3600;
        cfg->use_ino = 0;
        cfg->hard_remove = 1;
        /* Deep readahead and many background requests: each chunk that is not in RAM costs a cache file
         * open and read (or a server round trip), so sequential reads need many chunks in flight. */
        conn->max_readahead = 8 << 20;
        conn->max_write = 1 << 20;
        conn->max_background = 64;
        conn->congestion_threshold = 48;
        if (conn->capable & FUSE_CAP_ASYNC_DIO)
                conn->want |= FUSE_CAP_ASYNC_DIO;
        if (conn->capable & FUSE_CAP_PARALLEL_DIROPS)
                conn->want |= FUSE_CAP_PARALLEL_DIROPS;
        return fuse_get_context()->private_data;
}

static int op_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
        int file;

        (void) fi;
        memset(st, 0, sizeof(*st));
        st->st_uid = getuid();
        st->st_gid = getgid();
        st->st_nlink = 1;
        if (strcmp(path, "/") == 0) {
                st->st_mode = S_IFDIR | 0755;
                st->st_nlink = 2;
                return 0;
        }
        file = file_of(path);
        if (file < 0)
                return file;
        if (file == FILE_STATS) {
                st->st_mode = S_IFREG | 0444;
                return 0;
        }
        st->st_mode = S_IFREG | 0600;
        st->st_size = (off_t) image_size(daemon_image(current_daemon(), (DaemonImage) file));
        st->st_blocks = (st->st_size + 511) / 512;
        st->st_blksize = (blksize_t) image_chunk_size(daemon_image(current_daemon(), (DaemonImage) file));
        return 0;
}

static int op_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t offset, struct fuse_file_info *fi,
                      enum fuse_readdir_flags flags) {
        (void) offset;
        (void) fi;
        (void) flags;
        if (strcmp(path, "/") != 0)
                return -ENOTDIR;
        fill(buf, ".", NULL, 0, 0);
        fill(buf, "..", NULL, 0, 0);
        for (int i = 0; i < _FILE_MAX; i++)
                fill(buf, file_names[i], NULL, 0, 0);
        return 0;
}

static int op_open(const char *path, struct fuse_file_info *fi) {
        int file = file_of(path);
        StatsSnapshot *snap;
        int r;

        if (file < 0)
                return file;
        if (file != FILE_STATS) {
                if (fi->flags & O_TRUNC)
                        return -EPERM;
                fi->keep_cache = 1;
                fi->fh = (uint64_t) file;
                return 0;
        }
        if ((fi->flags & O_ACCMODE) != O_RDONLY)
                return -EACCES;
        snap = calloc(1, sizeof(*snap));
        if (!snap)
                return -ENOMEM;
        r = daemon_status_json(current_daemon(), &snap->text, &snap->len);
        if (r < 0) {
                free(snap);
                return r;
        }
        fi->direct_io = 1;
        fi->fh = (uint64_t) (uintptr_t) snap;
        return 0;
}

static int op_release(const char *path, struct fuse_file_info *fi) {
        if (file_of(path) == FILE_STATS) {
                StatsSnapshot *snap = (StatsSnapshot *) (uintptr_t) fi->fh;

                free(snap->text);
                free(snap);
        }
        return 0;
}

static int op_read(const char *path, char *buf, size_t size, off_t offset, struct fuse_file_info *fi) {
        int file = file_of(path);

        if (file < 0)
                return file;
        if (file == FILE_STATS) {
                StatsSnapshot *snap = (StatsSnapshot *) (uintptr_t) fi->fh;

                if ((size_t) offset >= snap->len)
                        return 0;
                if (size > snap->len - (size_t) offset)
                        size = snap->len - (size_t) offset;
                memcpy(buf, snap->text + offset, size);
                return (int) size;
        }
        return (int) image_read(daemon_image(current_daemon(), (DaemonImage) file), buf, size, (uint64_t) offset);
}

static int op_write(const char *path, const char *buf, size_t size, off_t offset, struct fuse_file_info *fi) {
        int file = file_of(path);

        (void) fi;
        if (file < 0)
                return file;
        if (file == FILE_STATS)
                return -EACCES;
        return (int) image_write(daemon_image(current_daemon(), (DaemonImage) file), buf, size, (uint64_t) offset);
}

static int flush_file(const char *path) {
        int file = file_of(path);
        int r;

        if (file < 0 || file == FILE_STATS)
                return file < 0 ? file : 0;
        r = image_flush(daemon_image(current_daemon(), (DaemonImage) file));
        return r < 0 ? -EIO : 0;
}

static int op_fsync(const char *path, int datasync, struct fuse_file_info *fi) {
        (void) datasync;
        (void) fi;
        return flush_file(path);
}

static int op_flush(const char *path, struct fuse_file_info *fi) {
        /* close(): cheap when nothing is dirty, and a closing QEMU expects its data to be safe. */
        if ((fi->flags & O_ACCMODE) == O_RDONLY)
                return 0;
        return flush_file(path);
}

static int op_truncate(const char *path, off_t size, struct fuse_file_info *fi) {
        int file = file_of(path);

        (void) fi;
        if (file < 0)
                return file;
        if (file == FILE_STATS || (uint64_t) size != image_size(daemon_image(current_daemon(), (DaemonImage) file)))
                return -EPERM;
        return 0;
}

static int op_statfs(const char *path, struct statvfs *st) {
        Daemon *d = current_daemon();
        uint64_t total = 0;

        (void) path;
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                total += image_size(daemon_image(d, (DaemonImage) i));
        memset(st, 0, sizeof(*st));
        st->f_bsize = 4096;
        st->f_frsize = 4096;
        st->f_blocks = total / 4096;
        st->f_files = _FILE_MAX;
        st->f_namemax = 255;
        return 0;
}

static int op_fallocate(const char *path, int mode, off_t offset, off_t length, struct fuse_file_info *fi) {
        (void) mode;
        (void) fi;
        if (file_of(path) < 0)
                return -ENOENT;
        /* The images are fully allocated already; growing them is not allowed. */
        if (offset < 0 || length < 0 ||
            (uint64_t) (offset + length) > image_size(daemon_image(current_daemon(), (DaemonImage) file_of(path))))
                return -EOPNOTSUPP;
        return mode == 0 ? 0 : -EOPNOTSUPP;
}

static const struct fuse_operations operations = {
        .init = op_init,
        .getattr = op_getattr,
        .readdir = op_readdir,
        .open = op_open,
        .release = op_release,
        .read = op_read,
        .write = op_write,
        .fsync = op_fsync,
        .flush = op_flush,
        .truncate = op_truncate,
        .statfs = op_statfs,
        .fallocate = op_fallocate,
};

int mount_new(Daemon *d, const FuseOptions *options, Mount **ret) {
        Mount *m;
        int r;

        m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        m->daemon = d;
        m->max_threads = options->max_threads ? options->max_threads : 64;
        m->mountpoint = strdup(options->mountpoint);
        if (!m->mountpoint) {
                r = -ENOMEM;
                goto out_free;
        }
        for (int i = 0; i < options->argc; i++)
                if (fuse_opt_add_arg(&m->args, options->argv[i]) < 0) {
                        r = -ENOMEM;
                        goto out_free;
                }
        m->fuse = fuse_new(&m->args, &operations, sizeof(operations), m);
        if (!m->fuse) {
                log_error("failed to set up the file system (bad FUSE options?)");
                r = -EINVAL;
                goto out_free;
        }
        if (fuse_mount(m->fuse, m->mountpoint) != 0) {
                log_error("failed to mount on %s", m->mountpoint);
                r = -EIO;
                goto out_free;
        }
        m->mounted = true;
        if (fuse_set_signal_handlers(fuse_get_session(m->fuse)) != 0) {
                r = -EIO;
                goto out_free;
        }
        *ret = m;
        return 0;

out_free:
        mount_free(m);
        return r;
}

int mount_run(Mount *m) {
        struct fuse_loop_config *config;
        int r;

        config = fuse_loop_cfg_create();
        if (!config)
                return -ENOMEM;
        fuse_loop_cfg_set_max_threads(config, m->max_threads);
        fuse_loop_cfg_set_idle_threads(config, 16);
        r = fuse_loop_mt(m->fuse, config);
        fuse_loop_cfg_destroy(config);
        return r == 0 ? 0 : -EIO;
}

Mount *mount_free(Mount *m) {
        if (!m)
                return NULL;
        if (m->fuse) {
                fuse_remove_signal_handlers(fuse_get_session(m->fuse));
                if (m->mounted)
                        fuse_unmount(m->fuse);
                fuse_destroy(m->fuse);
        }
        fuse_opt_free_args(&m->args);
        free(m->mountpoint);
        free(m);
        return NULL;
}
