/* errmsg.h: the one way a module reports bad input: a sentence written into the
 * caller's buffer, and a return code. Only run.c prints (run: <message>). */
#ifndef ERRMSG_H
#define ERRMSG_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

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

#endif /* ERRMSG_H */
