/* output.c: the output files (output.h). */
#include "serve/output.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/errmsg.h"
#include "kernels/fileio.h"

int output_open(FILE **out, const char *path, const NamedPath *inputs, int n_inputs, char *err, size_t errlen) {
    *out = NULL;
    struct stat target, input;
    if (stat(path, &target) == 0) { /* before the open: O_TRUNC would already have emptied an input */
        for (int i = 0; i < n_inputs && S_ISREG(target.st_mode); i++) /* two outputs may share /dev/null */
            if (inputs[i].path && stat(inputs[i].path, &input) == 0 && input.st_dev == target.st_dev &&
                input.st_ino == target.st_ino)
                return errmsg(err, errlen, 2, "cannot write %s: it is %s", msg_path(path).s, inputs[i].what);
        /* a regular file standard output or error already writes: the two would interleave */
        static const struct {
            int fd;
            const char *what;
        } streams[] = {{STDOUT_FILENO, "standard output"}, {STDERR_FILENO, "standard error"}};
        for (size_t i = 0; i < sizeof streams / sizeof streams[0] && S_ISREG(target.st_mode); i++)
            if (fstat(streams[i].fd, &input) == 0 && input.st_dev == target.st_dev && input.st_ino == target.st_ino)
                return errmsg(err, errlen, 2, "cannot write %s: standard %s already writes to it", msg_path(path).s,
                              streams[i].what + strlen("standard "));
        if (S_ISDIR(target.st_mode) || S_ISSOCK(target.st_mode) || S_ISBLK(target.st_mode))
            return errmsg(err, errlen, 2, "cannot write %s: it is a %s", msg_path(path).s, file_kind(target.st_mode));
    }
    /* O_NONBLOCK: opening a FIFO for writing waits for a reader; without one it fails at once */
    const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC, 0666);
    if (fd < 0 && errno == ENXIO)
        return errmsg(err, errlen, 1, "cannot write %s: it is a FIFO no process reads", msg_path(path).s);
    if (fd < 0) return errmsg(err, errlen, 1, "cannot write %s: %s", msg_path(path).s, strerror(errno));
    if (clear_nonblock(fd) != 0 || !(*out = fdopen(fd, "w"))) {
        const int e = errno;
        close(fd);
        return errmsg(err, errlen, 1, "cannot write %s: %s", msg_path(path).s, strerror(e));
    }
    return 0;
}
