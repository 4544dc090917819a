/* indexlist.c: lists of indices (indexlist.h). */
#include "serve/indexlist.h"

#include <string.h>

#include "kernels/errmsg.h"

/* A non-negative integer of at most 9 digits at *s, advancing *s past it; -1 when none. */
static long read_index(const char **s) {
    const char *p = *s;
    long v = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 10) v = v * 10 + (*p++ - '0'), digits++;
    if (digits == 0 || digits > 9) return -1;
    *s = p;
    return v;
}

int index_list_parse(IndexList *l, const char *s, const char *flag, char *err, size_t errlen) {
    memset(l, 0, sizeof *l);
    if (!strcmp(s, "all")) {
        l->all = 1;
        return 0;
    }
    const char *p = s;
    for (;;) {
        if (l->n == INDEX_LIST_MAX_RANGES)
            return errmsg(err, errlen, 2, "%s takes at most %d items, got '%s'", flag, INDEX_LIST_MAX_RANGES, s);
        const long lo = read_index(&p);
        long hi = lo;
        if (lo >= 0 && *p == '-') p++, hi = read_index(&p);
        if (lo < 0 || hi < 0 || (*p && *p != ','))
            return errmsg(err, errlen, 2, "%s takes all or indices like 0,3,5-7, got '%s'", flag, s);
        if (hi < lo) return errmsg(err, errlen, 2, "%s: the range %ld-%ld runs backwards in '%s'", flag, lo, hi, s);
        l->lo[l->n] = (int)lo, l->hi[l->n] = (int)hi, l->n++;
        if (!*p) return 0;
        p++; /* the comma */
    }
}

int index_list_has(const IndexList *l, int i) {
    if (l->all) return 1;
    for (int k = 0; k < l->n; k++)
        if (i >= l->lo[k] && i <= l->hi[k]) return 1;
    return 0;
}

int index_list_max(const IndexList *l) {
    int max = -1;
    for (int k = 0; !l->all && k < l->n; k++) max = l->hi[k] > max ? l->hi[k] : max;
    return max;
}
