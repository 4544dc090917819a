/* errmsg.h: the one way a module reports bad input: a sentence written into the
 * caller's buffer, and a return code. Only run.c prints (run: <message>). */
#ifndef ERRMSG_H
#define ERRMSG_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "kernels/utf8.h"

/* Writes the message into err (errlen bytes, always NUL-terminated when errlen > 0; cut
 * when longer; err may be NULL when errlen is 0) and returns code. */
__attribute__((format(printf, 4, 5))) static inline int errmsg(char *err, size_t errlen, int code, const char *fmt,
                                                               ...) {
    if (err && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* A path as a message shows it: whole, or when longer than MSG_PATH_BYTES its last bytes
 * after "...", so that what a message says after the path (an errno text) is never what a
 * full buffer cuts off; a control character (an escape sequence's ESC, say) shows as '?'
 * (utf8_mask_controls), so that no path can drive the terminal the message lands on. */
enum { MSG_PATH_BYTES = 160 };
typedef struct {
    char s[MSG_PATH_BYTES + 4];
} MsgPath;

static inline MsgPath msg_path(const char *path) {
    MsgPath m;
    const size_t n = strlen(path);
    if (n <= MSG_PATH_BYTES) {
        memcpy(m.s, path, n + 1);
    } else {
        const char *tail = path + n - (MSG_PATH_BYTES - 3);
        while (utf8_is_trail((unsigned char)*tail)) tail++; /* start at a character, not inside one */
        memcpy(m.s, "...", 3);
        memcpy(m.s + 3, tail, strlen(tail) + 1);
    }
    utf8_mask_controls(m.s);
    return m;
}

#endif /* ERRMSG_H */
