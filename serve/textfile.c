/* textfile.c: TinyStoriesV2-layout text files (see textfile.h). */
#include "serve/textfile.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/errmsg.h"
#include "kernels/fileio.h"
#include "kernels/utf8.h"

#define SEPARATOR "<|endoftext|>"
#define MAX_FILE_BYTES (1L << 30)

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

/* Strips [b, e) and records it as a story when anything is left. */
static int add_story(StoryFile *f, char *b, char *e, int *cap) {
    while (b < e && is_space(*b)) b++;
    while (e > b && is_space(e[-1])) e--;
    if (b == e) return 0;
    *e = '\0';
    if (f->n_stories == *cap) {
        int ncap = *cap ? *cap * 2 : 64;
        char **ns = realloc(f->stories, (size_t)ncap * sizeof *ns);
        if (!ns) return -1;
        f->stories = ns;
        *cap = ncap;
    }
    f->stories[f->n_stories++] = b;
    return 0;
}

/* Splits text (size bytes and a NUL, which f now owns) into stories. */
static int split_stories(StoryFile *f, char *text, size_t size, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    f->text = text;
    if (memchr(text, '\0', size)) {
        storyfile_free(f);
        return errmsg(err, errlen, -1, "the text holds a NUL byte");
    }
    int cap = 0;
    char *story = f->text, *line = f->text, *end = f->text + size;
    while (line <= end) {
        char *nl = memchr(line, '\n', (size_t)(end - line));
        char *line_end = nl ? nl : end;
        /* a separator line: only <|endoftext|>, with optional white space around it */
        char *b = line, *e = line_end;
        while (b < e && is_space(*b)) b++;
        while (e > b && is_space(e[-1])) e--;
        if ((size_t)(e - b) == strlen(SEPARATOR) && memcmp(b, SEPARATOR, strlen(SEPARATOR)) == 0) {
            if (add_story(f, story, line, &cap) != 0) goto oom;
            story = nl ? nl + 1 : end;
        }
        if (!nl) break;
        line = nl + 1;
    }
    if (add_story(f, story, end, &cap) != 0) goto oom;
    for (int i = 0; i < f->n_stories; i++)
        if (!utf8_valid(f->stories[i], strlen(f->stories[i]))) {
            errmsg(err, errlen, -1, "story %d is not valid UTF-8 text", i + 1);
            storyfile_free(f);
            return -1;
        }
    if (f->n_stories == 0) {
        errmsg(err, errlen, -1, "no story found (stories are separated by lines holding only %s)", SEPARATOR);
        storyfile_free(f);
        return -1;
    }
    return 0;
oom:
    errmsg(err, errlen, -1, "out of memory reading stories");
    storyfile_free(f);
    return -1;
}

int storyfile_parse(StoryFile *f, const char *data, size_t size, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    char *text = malloc(size + 1);
    if (!text) return errmsg(err, errlen, -1, "out of memory reading stories");
    memcpy(text, data, size);
    text[size] = '\0';
    return split_stories(f, text, size, err, errlen);
}

MsgPath input_name(const char *path) { return msg_path(strcmp(path, "-") ? path : "standard input"); }

/* Standard input may be a pipe or a terminal, so it is read to its end, up to a bound. */
enum { MAX_STDIN_BYTES = 1 << 20 };
static int read_stdin(char **out, size_t *n_out, char *err, size_t errlen) {
    char *buf = malloc(MAX_STDIN_BYTES + 1);
    if (!buf) return errmsg(err, errlen, -1, "out of memory reading standard input");
    size_t n = 0;
    for (;;) {
        const ssize_t got = read(STDIN_FILENO, buf + n, MAX_STDIN_BYTES + 1 - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            free(buf);
            return errmsg(err, errlen, -1, "cannot read standard input: %s", strerror(errno));
        }
        if (got == 0) break;
        n += (size_t)got;
        if (n > MAX_STDIN_BYTES) {
            free(buf);
            return errmsg(err, errlen, -1, "standard input is over %d bytes", MAX_STDIN_BYTES);
        }
    }
    buf[n] = '\0';
    *out = buf;
    *n_out = n;
    return 0;
}

/* The whole file ("-": standard input) in a new buffer (*n bytes, NUL-terminated), or -1
 * with the reason in err. A file's size is known before the first read, so the buffer is
 * allocated once. */
static int read_whole(const char *path, char **out, size_t *n_out, char *err, size_t errlen) {
    if (!strcmp(path, "-")) return read_stdin(out, n_out, err, errlen);
    size_t size;
    const int fd = open_regular(path, "", &size, err, errlen);
    if (fd < 0) return -1;
    char *buf = NULL;
    if (size > (size_t)MAX_FILE_BYTES) {
        errmsg(err, errlen, -1, "%s is over 1 GiB", input_name(path).s);
    } else if (!(buf = malloc(size + 1))) {
        errmsg(err, errlen, -1, "out of memory reading %s", input_name(path).s);
    } else if (read_at(fd, buf, size, 0) != 0) {
        if (errno)
            errmsg(err, errlen, -1, "cannot read %s: %s", input_name(path).s, strerror(errno));
        else
            errmsg(err, errlen, -1, "%s shrank while it was being read", input_name(path).s);
        free(buf);
        buf = NULL;
    } else if (pread(fd, &(char){0}, 1, (off_t)size) > 0) { /* more than its size said: never a silent cut */
        errmsg(err, errlen, -1, "%s grew while it was being read, or does not report its size (as files in /proc do)",
               input_name(path).s);
        free(buf);
        buf = NULL;
    }
    close(fd);
    if (!buf) return -1;
    buf[size] = '\0';
    *out = buf;
    *n_out = size;
    return 0;
}

int storyfile_read(StoryFile *f, const char *path, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    char *buf;
    size_t n;
    if (read_whole(path, &buf, &n, err, errlen) != 0) return -1;
    char inner[256];
    int rc = split_stories(f, buf, n, inner, sizeof inner);
    if (rc != 0) errmsg(err, errlen, -1, "%s: %s", input_name(path).s, inner);
    return rc;
}

void storyfile_free(StoryFile *f) {
    free(f->text);
    free(f->stories);
    memset(f, 0, sizeof *f);
}

int promptfile_read(PromptFile *f, const char *path, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    size_t n;
    if (read_whole(path, &f->text, &n, err, errlen) != 0) return -1;
    if (memchr(f->text, '\0', n)) {
        promptfile_free(f);
        return errmsg(err, errlen, -1, "%s holds a NUL byte", input_name(path).s);
    }
    int cap = 0, line_no = 0;
    for (char *line = f->text; line < f->text + n || line_no == 0;) {
        line_no++;
        char *nl = strchr(line, '\n'), *end = nl ? nl : line + strlen(line);
        if (end > line && end[-1] == '\r') end--;
        *end = '\0';
        char *b = line;
        while (b < end && is_space(*b)) b++;
        if (b < end) { /* a blank line holds no prompt */
            if (!utf8_valid(line, (size_t)(end - line))) {
                promptfile_free(f);
                return errmsg(err, errlen, -1, "%s:%d: the prompt is not valid UTF-8 text", input_name(path).s,
                              line_no);
            }
            if (f->n_prompts == cap) {
                cap = cap ? 2 * cap : 64;
                char **np = realloc(f->prompts, (size_t)cap * sizeof *np);
                int *nl_no = realloc(f->line_numbers, (size_t)cap * sizeof *nl_no);
                if (np) f->prompts = np;
                if (nl_no) f->line_numbers = nl_no;
                if (!np || !nl_no) {
                    promptfile_free(f);
                    return errmsg(err, errlen, -1, "out of memory reading %s", input_name(path).s);
                }
            }
            f->prompts[f->n_prompts] = line;
            f->line_numbers[f->n_prompts++] = line_no;
        }
        if (!nl) break;
        line = nl + 1;
    }
    if (f->n_prompts == 0) {
        promptfile_free(f);
        return errmsg(err, errlen, -1, "%s holds no prompt (one prompt a line)", input_name(path).s);
    }
    return 0;
}

void promptfile_free(PromptFile *f) {
    free(f->text);
    free(f->prompts);
    free(f->line_numbers);
    memset(f, 0, sizeof *f);
}

int textfile_read_text(const char *path, char **text, char *err, size_t errlen) {
    size_t n;
    if (read_whole(path, text, &n, err, errlen) != 0) return -1;
    const char *bad = memchr(*text, '\0', n)  ? "holds a NUL byte"
                      : !utf8_valid(*text, n) ? "is not valid UTF-8 text"
                                              : NULL;
    if (!bad) return 0;
    free(*text);
    *text = NULL;
    return errmsg(err, errlen, -1, "%s %s", input_name(path).s, bad);
}
