/* fileio.c: opening the files ./run reads (fileio.h). */
#include "kernels/fileio.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/errmsg.h"

const char *file_kind(mode_t mode) {
    return S_ISDIR(mode)    ? "directory"
           : S_ISFIFO(mode) ? "FIFO"
           : S_ISSOCK(mode) ? "socket"
           : S_ISCHR(mode)  ? "character device"
           : S_ISBLK(mode)  ? "block device"
                            : "special file";
}

int open_regular(const char *path, const char *what, size_t *size, char *err, size_t errlen) {
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return errmsg(err, errlen, -1, "cannot open %s%s: %s", what, msg_path(path).s, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        const int e = errno;
        close(fd);
        return errmsg(err, errlen, -1, "cannot read %s%s: %s", what, msg_path(path).s, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return errmsg(err, errlen, -1, "%s%s is a %s, not a regular file", what, msg_path(path).s,
                      file_kind(st.st_mode));
    }
    if (clear_nonblock(fd) != 0) {
        const int e = errno;
        close(fd);
        return errmsg(err, errlen, -1, "cannot read %s%s: %s", what, msg_path(path).s, strerror(e));
    }
    *size = (size_t)st.st_size;
    return fd;
}

int clear_nonblock(int fd) {
    const int flags = fcntl(fd, F_GETFL);
    return flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 ? -1 : 0;
}

int read_at(int fd, void *buf, size_t n, size_t off) {
    char *p = buf;
    while (n > 0) {
        const ssize_t got = pread(fd, p, n, (off_t)off);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            if (got == 0) errno = 0;
            return -1;
        }
        p += got;
        off += (size_t)got;
        n -= (size_t)got;
    }
    return 0;
}
